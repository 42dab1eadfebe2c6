"""The CPU backend (backend.py's CpuBackend): how this machine reads a model's weights.

weight_image.py: the float32 weights prepared once per GGUF and memory-mapped; weight_layout.py:
which layout of them BLAS reads fastest here, measured once; shared_matmul.py with
helper_process.py: a decode pass's matmuls shared with helper processes; blas_threads.py:
BLAS threads that fit the cores other processes leave free; malloc.py: glibc's malloc set for
an engine (engine.tune_process). Nothing is imported here: malloc.py must load without NumPy.
"""
