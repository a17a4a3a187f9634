"""Where the GPU backend runs and how its ranks talk.

device.py  ``Device`` (what ``CupyBackend`` asks of a device) and ``CupyDevice`` (a GPU through
           CuPy: memory, streams, its own cuBLAS handle, CUDA graphs); ``EmulatedDevice`` is in
           engine/emulation/
comm.py    the shared-memory all-reduce and all-gather between the ranks of a stage
nccl.py    NCCL for the GPU backend's ranks (``cupy.cuda.nccl``)
"""
