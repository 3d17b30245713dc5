"""python -m step20_http_serve --model PATH --port 8000: an OpenAI-compatible server.

Flags follow `vllm serve`'s names. Then, for example:
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
or a chat in the terminal, as `vllm chat` (chat.py; without --url it serves the model itself):
    python -m step20_http_serve chat --url http://localhost:8000/v1
"""
from __future__ import annotations

import argparse
import sys

from minivllm_support.cpu import auto_dtype
from minivllm_support.models import resolve_model
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from step17_tensor_parallel.lifeline import honour_lifeline_env
from step17_tensor_parallel.node import run_torchrun_worker
from step18_benchmark.faults import EngineDead, FaultPolicy
from step19_real_model.llm import DTYPES
from step20_http_serve.server import EXIT_ENGINE_DEAD, build_server, serve


def main(argv: list[str] | None = None, build=build_server) -> None:
    """`build` makes (app, AsyncLLM) from the flags (and threaded=False: the engine loop runs in
    this thread, see `serve`); a later lesson passes its own. `chat ...` runs the terminal chat;
    `serve ...` is the same as no subcommand."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["chat"]:
        from step20_http_serve.chat import main as chat_main
        sys.exit(chat_main(argv[1:]))
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m step20_http_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: $MINIVLLM_MODEL, a cached "
                   "Qwen3-0.6B, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "bfloat16", "fp32", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=16, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="size of the KV block pool")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` "
                   "(default: the checkpoint path)")
    p.add_argument("--enforce-eager", action="store_true", help="skip compiling the decode step "
                   "(fast start-up, slower decoding)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is split over "
                   "(lesson 17); with --nnodes > 1 the other nodes run `python -m step17_tensor_parallel.node`")
    add_launch_flags(p)
    p.add_argument("--max-body-mib", type=int, default=16, help="largest request body accepted")
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-step-faults", type=int, default=3, help="engine step faults within "
                   "--step-fault-window-s that make the engine dead (the process then exits with code "
                   f"{EXIT_ENGINE_DEAD})")
    p.add_argument("--step-fault-window-s", type=float, default=60.0)
    p.add_argument("--fault-marker", default=None, help="lesson and soak tool: the engine step holding a "
                   "prompt that contains this text raises (its requests get 500, the others go on)")
    args = p.parse_args(argv)
    honour_lifeline_env()                    # started by popen_tied (the soak): end with that process
    if args.max_step_faults < 1 or args.step_fault_window_s <= 0:
        p.error("--max-step-faults must be >= 1 and --step-fault-window-s > 0")
    if args.node_rank != 0:
        p.error("nodes other than 0 run headless workers: python -m step17_tensor_parallel.node (same flags)")
    dtype = auto_dtype() if args.dtype == "auto" else DTYPES[args.dtype]
    run_torchrun_worker(resolve_model(args.model), args.tensor_parallel_size, dtype)   # torchrun, rank > 0
    app, engine = build(args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               kv_cache_bytes=args.kv_cache_mib * 2**20, enforce_eager=args.enforce_eager,
                               max_body_bytes=args.max_body_mib * 2**20, threaded=False,
                               fault_marker=args.fault_marker,
                               policy=FaultPolicy(args.max_step_faults, args.step_fault_window_s),
                               tensor_parallel_size=args.tensor_parallel_size, launch=launch_from_args(args))
    print(f"serving {engine.model_name!r} (context {engine.max_model_len} tokens) on http://{args.host}:{args.port}",
          flush=True)
    try:
        serve(app, args.host, args.port, args.log_level, front=engine.front)
    finally:
        engine.shutdown()
    if isinstance(engine.front.error, EngineDead):
        print(f"exiting with code {EXIT_ENGINE_DEAD}: {engine.front.error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_ENGINE_DEAD)


if __name__ == "__main__":
    main()
