"""UPipe's overlapped stages (beyond the paper): the stages' all-to-alls beside the attention
kernels (``overlap=True``, ``upipe/untied.py``) against the paper's blocking schedule and
Ulysses.

Real CPU runs: one attention layer's forward and backward (the ``attention`` workload of the
main harness; Llama3-8B's heads at a CPU-sized width, the ``bench-attn`` preset), 2 gloo ranks,
2K to 8K tokens; gloo runs the asynchronous all-to-alls on its worker threads, beside the
kernels. The paper-scale counterparts are the ``upipe overlap`` rows of Tables 3 and 4
(``table3_llama3_8b_h100x8``, ``table4_qwen3_32b_h100x16``, emulated).
"""

from experiments.config import Sweep

METHODS = [{"method": "ulysses"}, {"method": "upipe"}, {"method": "upipe", "overlap": True}]

SWEEPS = [
    Sweep(
        name="upipe_overlap-cpu",
        description="UPipe with and without overlapped stages, and Ulysses: one attention layer,"
                    " 2 gloo ranks, 2K-8K tokens",
        scale="cpu",
        base={"workload": "attention", "model": "bench-attn", "nproc": 2, "dtype": "fp32",
              "stack": "none", "warmup": 2, "iters": 5},
        axes={"seq_len": ["2K", "4K", "8K"], "variant": METHODS},
        plots=("throughput_vs_ulysses",),
        timeout_s=900,
    ),
]
