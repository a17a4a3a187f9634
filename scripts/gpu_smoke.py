"""The GPU check's first minute: does every piece of the GPU path work at all?

    python scripts/gpu_smoke.py --out DIR [--emulate]

Each check runs on its own (one failing does not stop the next) and ``DIR/smoke.json`` is
rewritten after each one, so whatever ran is on disk even if the process is killed:

    device    the device comes up: CuPy, the stream, the engine's cuBLAS handle
    compile   every kernel module compiled, every entry point loaded
    kernels   each kernel launched once on fresh random inputs against its NumPy twin
    gemm      one bfloat16 product through the engine's handle against float32 NumPy
    graph     a captured graph holding a gemm and a kernel, replayed on new inputs
    pinned    a pinned host buffer copied to the device and back

``--emulate`` runs the same checks on the emulated device (``cuda-cpu``), as CI does.
Exit status: 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.emulation import kernel_ops as C  # noqa: E402
from engine.kernels.launch import lora_tiles  # noqa: E402
from reference import kernel_ops as N  # noqa: E402


def make_device(emulate: bool):
    from engine.devices.device import CupyDevice
    from engine.emulation.device import EmulatedDevice

    return EmulatedDevice() if emulate else CupyDevice()


def close(got, want, tol: float) -> float:
    """Max abs error; AssertionError when it exceeds ``tol`` (or a NaN: never written)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.abs(got - want).max()) if got.size else 0.0
    if not err <= tol:
        raise AssertionError(f"max abs error {err:.3g} > {tol:g}")
    return err


def poisoned(dev, shape, dtype=np.float32):
    return dev.upload(np.full(shape, np.nan, dtype))


def check_kernels(dev, rng) -> dict:
    """Every kernel once, float32, against numpy_ops (sampling: against its Philox twin)."""
    k, up, down = dev.kernels, dev.upload, dev.download
    T, D, F, V, H, Hkv, hd, bs = 7, 64, 48, 300, 4, 2, 32, 16
    x, r = rng.standard_normal((T, D), np.float32), rng.standard_normal((T, D), np.float32)
    w = rng.standard_normal(D, np.float32)
    errors = {}

    out = poisoned(dev, (T, D))
    k.rms_norm(out, up(x), up(w), 1e-5)
    errors["rms_norm"] = close(down(out), N.rms_norm(x, w, 1e-5), 1e-4)
    out, res = poisoned(dev, (T, D)), up(r)
    k.fused_add_rms_norm(out, res, up(x), up(w), 1e-5)
    want_out, want_res = N.fused_add_rms_norm(x, r, w, 1e-5)
    errors["fused_add_rms_norm"] = max(
        close(down(out), want_out, 1e-4), close(down(res), want_res, 1e-5)
    )
    table, ids = rng.standard_normal((V, D), np.float32), rng.integers(0, V, T).astype(np.int32)
    out = poisoned(dev, (T, D))
    k.embedding(out, up(ids), up(table))
    errors["embedding"] = close(down(out), N.embedding(ids, table), 0)
    gu, out = rng.standard_normal((T, 2 * F), np.float32), poisoned(dev, (T, F))
    k.silu_and_mul(out, up(gu))
    errors["silu_and_mul"] = close(down(out), N.silu_and_mul(gu), 1e-5)
    errors |= check_paged(dev, rng, H, Hkv, hd, bs)
    logits = rng.standard_normal((5, V), np.float32) * 3
    ids = up(np.full(5, -1, np.int32))
    k.sample_greedy(ids, up(logits))
    errors["sample_greedy"] = close(down(ids), np.argmax(logits, 1), 0)
    errors["lora"] = check_lora(dev, rng)
    errors |= check_experts(dev, rng)
    return {"max_abs_error": errors}


def check_experts(dev, rng) -> dict:
    """A layer of experts (moe_route, moe_align, moe_matmul, act_and_mul's clamped SwiGLU,
    moe_combine) on 9 tokens, top 2 of 6, against engine/backends/moe.py on the host; add_bias
    and olmoe_qkv against NumPy."""
    from engine.backends import moe

    k, up, down = dev.kernels, dev.upload, dev.download
    T, D, F, E, K = 9, 64, 32, 6, 2
    h = rng.standard_normal((T, D), np.float32)
    router = rng.standard_normal((E, D), np.float32)
    w_gu = rng.standard_normal((E, 2 * F, D), np.float32) / 8
    w_dn = rng.standard_normal((E, D, F), np.float32) / 8
    ids, w = up(np.zeros((T, K), np.int32)), up(np.zeros((T, K), np.float32))
    k.moe_route(ids, w, up(h), up(router), K, True)
    sp, inv = up(np.zeros(T * K, np.int32)), up(np.zeros(T * K, np.int32))
    offs, totals = up(np.zeros(E + 1, np.int32)), up(np.zeros(E, np.uint64))
    k.moe_align(sp, inv, offs, totals, ids, up(np.arange(T, dtype=np.int32)))
    gu, act = poisoned(dev, (T * K, 2 * F)), poisoned(dev, (T * K, F))
    k.moe_matmul(gu, up(h), up(w_gu), sp, offs, K)
    k.clamped_swiglu(act, gu, 1.702, 7.0)
    y, out = poisoned(dev, (T * K, D)), poisoned(dev, (T, D))
    k.moe_matmul(y, act, up(w_dn), sp, offs, 0)
    k.moe_combine(out, y, w, inv)
    want = np.zeros((T, D), np.float32)
    want_ids, want_w = moe.route(h, router.T.copy(), K, True)
    for t in range(T):
        for e, weight in zip(want_ids[t], want_w[t], strict=True):
            a = moe.clamped_swiglu((w_gu[e] @ h[t])[None], 1.702, 7.0)[0]
            want[t] += weight * (w_dn[e] @ a)
    errors = {"moe": close(down(out), want, 1e-4), "moe_route": close(down(ids), want_ids, 0)}
    x, bias = rng.standard_normal((T, D), np.float32), rng.standard_normal(D, np.float32)
    xd = up(x)
    k.add_bias(xd, up(bias))
    errors["add_bias"] = close(down(xd), x + bias, 1e-6)
    qkv = rng.standard_normal((T, 3 * D), np.float32) * 3
    qd = up(qkv)
    k.olmoe_qkv(qd, D, D, clip=2.0)
    errors["olmoe_qkv"] = close(down(qd), np.clip(qkv, -2.0, 2.0), 0)
    return errors


def check_lora(dev, rng) -> float:
    """lora_shrink + lora_expand: 40 rows over two adapters and the base model, q|k|v modules,
    against float64 NumPy."""
    T, K, R, widths = 40, 96, 8, (64, 32, 32)
    ends, N = np.cumsum(widths).astype(np.int32), sum(widths)
    x, y = rng.standard_normal((T, K), np.float32), rng.standard_normal((T, N), np.float32)
    a = rng.standard_normal((2, 3 * R, K), np.float32)
    b = rng.standard_normal((2, R, N), np.float32)
    slots = rng.integers(-1, 2, T).astype(np.int32)
    want = y.astype(np.float64)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            t = a[s].astype(np.float64) @ x[i]
            for m, (c0, c1) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
                want[i, c0:c1] += t[m * R : (m + 1) * R] @ b[s][:, c0:c1]
    order, tiles = lora_tiles(slots)
    out = dev.upload(y)
    dev.kernels.lora(out, dev.upload(x), dev.upload(a), dev.upload(b), dev.upload(order),
                     dev.upload(tiles), dev.upload(ends))  # fmt: skip
    return close(dev.download(out), want, 1e-3)


def check_paged(dev, rng, H, Hkv, hd, bs) -> dict:
    """rotary_cache, decode attention (one and two partitions), prefill, copy_blocks."""
    k, up, down = dev.kernels, dev.upload, dev.download
    nb, lens = 24, np.array([1, 17, 40, 90], np.int32)
    kc, vc = (rng.standard_normal((nb, bs, Hkv, hd), np.float32) for _ in range(2))
    tables = rng.permutation(nb)[:24].astype(np.int32).reshape(4, 6)  # (B, M) distinct blocks
    errors = {}
    T = 20
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd), np.float32)
    pos = rng.integers(0, 500, T).astype(np.int32)
    slots = rng.permutation(nb * bs)[:T].astype(np.int32)
    slots[::7] = -1  # padding rows: no K/V written
    kc_d, vc_d, q_d = up(kc), up(vc), poisoned(dev, (T, H, hd))
    k.rotary_cache(q_d, kc_d, vc_d, up(qkv), up(pos), up(slots), up(C.rope_table(512, hd, 1e4)))
    want_q = N.rotary_cache(qkv, pos, 1e4, kc, vc, slots, H)
    errors["rotary_cache"] = max(
        close(down(q_d), want_q, 1e-4), close(down(kc_d), kc, 1e-4), close(down(vc_d), vc, 0)
    )
    q = rng.standard_normal((4, H, hd), np.float32)
    want = N.paged_attention_decode(q, kc, vc, tables, lens, hd**-0.5)
    for partition in (512, 64):  # 64: two partitions and the reduce kernel
        out = poisoned(dev, q.shape)
        k.paged_attention_decode(
            out, up(q), kc_d, vc_d, up(tables), up(lens), hd**-0.5, 90, partition
        )
        errors[f"paged_attention_decode/{partition}"] = close(down(out), want, 1e-4)
    q_lens = np.array([1, 5, 40, 3], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qp = rng.standard_normal((int(qsl[-1]), H, hd), np.float32)
    out = poisoned(dev, qp.shape)
    k.paged_attention_prefill(out, up(qp), kc_d, vc_d, up(tables), up(qsl), up(lens), hd**-0.5)
    want = N.paged_attention_prefill(qp, kc, vc, tables, qsl, lens, hd**-0.5)
    errors["paged_attention_prefill"] = close(down(out), want, 1e-4)
    pool = rng.standard_normal((2, 2, 8, bs, Hkv, hd), np.float32)
    pairs = np.array([[1, 5], [2, 6]], np.int32)
    pool_d = up(pool)
    k.copy_blocks(pool_d, pool_d, up(pairs))
    N.copy_blocks(pool, pool, pairs)
    errors["copy_blocks"] = close(down(pool_d), pool, 0)
    return errors


def check_gemm(dev, rng) -> dict:
    M, K, N_ = 33, 2048, 512
    x = rng.standard_normal((M, K), np.float32).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((N_, K), np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    out = dev.empty((M, N_), np.float32)
    dev.gemm(dev.upload(x), dev.upload(w), out)
    want = x.astype(np.float32) @ w.astype(np.float32).T
    return {"max_abs_error": close(dev.download(out), want, 1e-3)}


def check_graph(dev, rng) -> dict:
    x_d = dev.upload(rng.standard_normal((9, 256), np.float32))
    w = rng.standard_normal((128, 256), np.float32)
    w_d = dev.upload(w)

    def step():  # a gemm and a kernel, temporaries allocated inside
        y, act = dev.empty((9, 128), np.float32), dev.empty((9, 64), np.float32)
        dev.gemm(x_d, w_d, y)
        dev.kernels.silu_and_mul(act, y)
        return act

    t0 = time.perf_counter()
    replay = dev.capture(step)
    seconds = time.perf_counter() - t0
    host = dev.pinned_empty((9, 256), np.float32)
    errors = []
    for _ in range(2):
        host[...] = x_new = rng.standard_normal((9, 256), np.float32)
        dev.copy_to(x_d, host)
        want = N.silu_and_mul(x_new @ w.T)  # (9, 64), values in the hundreds
        # relative to the largest value: float32 sums of 256 products in another order
        errors.append(close(dev.download(replay()), want, 2e-5 * float(np.abs(want).max())))
    return {"capture_s": seconds, "max_abs_error": max(errors)}


def check_pinned(dev, rng) -> dict:
    n = 1 << 20
    host = dev.pinned_empty((n,), np.float32)
    host[...] = data = rng.standard_normal(n, np.float32)
    dst = dev.empty((n,), np.float32)
    dev.copy_to(dst, host)
    back = dev.download(dst)
    return {"bytes": 4 * n, "max_abs_error": close(back, data, 0)}


def run(out_dir: Path, emulate: bool) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"emulate": emulate, "checks": {}}
    rng = np.random.default_rng()
    dev = None

    def record(name, fn):
        t0 = time.perf_counter()
        try:
            entry = {"ok": True, **(fn() or {})}
        except Exception as exc:
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            entry["traceback"] = traceback.format_exc()
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        results["checks"][name] = entry
        (out_dir / "smoke.json").write_text(json.dumps(results, indent=2, default=float))
        status = "ok" if entry["ok"] else f"FAILED: {entry['error']}"
        print(f"{name:8s} {entry['seconds']:7.2f} s  {status}", flush=True)
        return entry["ok"]

    def device():
        nonlocal dev
        dev = make_device(emulate)
        return {"name": dev.name, "cublas_version": dev.cublas.version()}

    if record("device", device):
        with dev.active():
            record("compile", lambda: dev.compile_kernels())
            record("kernels", lambda: check_kernels(dev, rng))
            record("gemm", lambda: check_gemm(dev, rng))
            record("graph", lambda: check_graph(dev, rng))
            record("pinned", lambda: check_pinned(dev, rng))
    return 0 if all(c["ok"] for c in results["checks"].values()) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for smoke.json")
    p.add_argument("--emulate", action="store_true", help="the emulated device, not a GPU")
    args = p.parse_args(argv)
    return run(args.out, args.emulate)


if __name__ == "__main__":
    raise SystemExit(main())
