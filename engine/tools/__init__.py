"""Tools beside the product: benchmarks, measurements and the run replay.

bench.py           ``python -m engine.bench``: an offline workload, tokens/s, TTFT and ITL,
                   peers (transformers) and plots (bench_plot.py, plots.py)
bench_serve.py     ``python -m engine.bench_serve``: the same against a running server
bench_gpu.py       GPU measurements, each figure next to its ceiling
host_overhead.py   the host's cost per decode step, the forward stubbed
quant_eval.py      ``python -m engine.quant_eval``: a weight format's perplexity and KL
prebuild.py        ``python -m engine.tools.prebuild run|test``: the kernels' CPU builds, ahead
live_server.py     the OpenAI server in a thread on an ephemeral port (tests, soak scripts)
soak_mix.py        the request mix of the soak tests and scripts
"""
