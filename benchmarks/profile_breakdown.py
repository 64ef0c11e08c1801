"""Where a serving run's time goes: py-spy samples of `loragw serve` (the
gateway and its engine worker), grouped by what the code does.

benchmarks/serve_peer.py records them (`--py-spy-level C`: py-spy attached
to the gateway and its subprocesses for the whole of level C, idle threads
not sampled, so a sample is time a thread was running Python or a call it
made); this reads py-spy's raw (collapsed-stack) file:

    python benchmarks/profile_breakdown.py benchmarks/results/serve_peer_profile.txt

Each sample goes to the first category, in the order listed, whose rule
matches any frame of its stack: the specific before the general, so the LM
head's matmul is "LM head", not "linear layers", and a projection is
"linear layers", not the decoder layer that called it. Shares are of each
process's samples.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

# (category, pattern over "function (file:line)"), the first that matches wins.
WORKER_RULES = (
    ("LM head", r"compute_logits \("),
    ("LoRA", r"\(adapters/"),
    ("attention", r"\(engine/attention/"),
    ("linear layers", r"\(engine/model/(cpu_linear|quant)"),
    ("rotary", r"\(engine/model/rope\.py"),
    ("norms, MLP activation, residuals", r"\(engine/model/llama\.py"),
    ("sampling", r"\(engine/(sampler|structured/)"),
    ("batch inputs and block copies", r"_prepare_inputs \(|_copy_blocks \("),
    ("scheduler and KV manager", r"\(engine/(scheduler|kv_cache_manager|block_pool|adapter_slots|block_hash)"),
    ("outputs and detokenizing", r"\(engine/(output_processor|detokenizer)"),
    ("worker protocol and stats", r"\(engine/(wire|worker\.py|snapshot|usage_split)|zmq/|msgspec"),
)
GATEWAY_RULES = (
    ("tokenizing and templating", r"\(gateway/prepare|tokenizers|transformers/|chat_template"),
    ("SSE and response bodies", r"\(gateway/(streaming|openai_format|tool_stream)"),
    ("worker client", r"\(gateway/(engine_client|workers/)"),
    ("store, auth, metering", r"\(gateway/(store|auth_cache|metering|tenant_limits)|sqlalchemy|aiosqlite"),
    ("HTTP server", r"uvicorn|starlette|h11|httptools"),
    ("event loop", r"asyncio/"),
)


def parse(path: Path) -> dict[str, Counter]:
    """process kind ("worker", "gateway", "other") -> category -> samples."""
    out: dict[str, Counter] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # py-spy nests a child's "process PID:cmdline" frame under its parent's.
        processes = [f for f in frames if f.startswith("process ")]
        code = [f for f in frames if not f.startswith("process ")]
        kind, rules = _process(processes[-1] if processes else "")
        out[kind][_category(code, rules)] += int(count)
    return out


def _process(head: str):
    if "engine.worker" in head:
        return "worker", WORKER_RULES
    if "gateway.cli" in head:
        return "gateway", GATEWAY_RULES
    return "other", ()


def _category(frames: list[str], rules) -> str:
    for name, pattern in rules:
        if any(re.search(pattern, frame) for frame in frames):
            return name
    return "other"


def shares(counts: dict[str, Counter]) -> dict:
    out = {}
    for kind, counter in counts.items():
        total = sum(counter.values())
        out[kind] = {"samples": total,
                     "share": {name: round(n / total, 3) for name, n in counter.most_common()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = shares(parse(args.raw))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for kind, summary in result.items():
        print(f"{kind}: {summary['samples']} samples")
        for name, share in summary["share"].items():
            print(f"  {share:6.1%}  {name}")


if __name__ == "__main__":
    main()
