"""The `loragw` command.

`loragw serve` is, until the HTTP gateway lands, a chat demo on the default
model: interactive on a terminal, one-shot otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from gateway import cli_admin
import time

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
]


def _engine_args(args: argparse.Namespace) -> dict:
    out = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.kv_cache_memory is not None:
        out["kv_cache_memory"] = args.kv_cache_memory
    return out


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--model", default=env("LORAGW_MODEL"),
                   help="local HF-format Llama checkpoint; default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default=env("LORAGW_DTYPE", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=int(env("LORAGW_MAX_NUM_SEQS", "128")))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=int(env("LORAGW_MAX_NUM_BATCHED_TOKENS", "1024")))
    p.add_argument("--kv-cache-memory", type=int, default=env("LORAGW_KV_CACHE_MEMORY"),
                   help="KV cache budget in bytes")


def _serve(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.errors import EngineError

    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, **_engine_args(args))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"loaded {llm.engine.model_dir} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    interactive = sys.stdin.isatty() and not args.prompt
    questions = [args.prompt] if args.prompt else DEMO_QUESTIONS
    history: list[dict] = []
    while True:
        if interactive:
            try:
                question = input("you> ").strip()
            except EOFError:
                return 0
            if not question:
                continue
        elif questions:
            question = questions.pop(0)
            print(f"you> {question}")
        else:
            return 0
        history.append({"role": "user", "content": question})
        start = time.perf_counter()
        out = llm.chat(history, params)[0]
        elapsed = time.perf_counter() - start
        answer = out.outputs[0].text.strip()
        history.append({"role": "assistant", "content": answer})
        if not interactive:
            history.clear()
        n = len(out.outputs[0].token_ids)
        print(f"bot> {answer}\n     [{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loragw", description="multi-tenant LoRA inference gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="chat with the model (the HTTP gateway comes later)")
    _add_engine_flags(serve)
    serve.add_argument("--prompt", help="answer one question and exit")
    serve.add_argument("--max-tokens", type=int, default=128)
    cli_admin.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command in cli_admin.COMMANDS:
        return cli_admin.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
