"""Benchmarks, one command: `python -m inference.tools.bench [SUBCOMMAND] [OPTIONS]` (__main__.py).

    models     prefill tok/s, decode ms/step, weight GB/s, peak memory of random models (the default)
    experts    the CPU routed-expert kernel on one MoE layer of the released geometry
    convert    convert.py's throughput against cp, and its peak RSS, on a synthetic checkpoint
    offload    --offload disk: a prefill streamed from a checkpoint larger than the memory it may use
    launches   device ops and host syncs of a decode step and a prefill, per module kind and route
    serve      the OpenAI endpoint (generate.py --serve): requests/s, time to first token, HTTP overhead

common.py holds what several share. Figures are printed, never asserted.
"""
