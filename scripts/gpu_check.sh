#!/usr/bin/env bash
# The device check: everything tiergate runs differently on a CUDA machine, in one prepared run
# (docs/BENCHMARKS.md, "On a GPU"). Needs torch, triton, transformers, peft and pytest there;
# diffusers, soundfile and pydantic come as wheels in .whl/ where the machine lacks them.
#
#   scripts/gpu_check.sh [OUT]        # OUT: where logs and JSON go (default bench-results/gpu)
#
# Steps, each under its own time limit, each run whatever the others did:
#   kernels  the CUDA tests of lora_kernels and the footprint (pytest, no conftest: no server)
#   lora     scripts/gpu_check_lora.py: Triton parity natively on CUDA and bench_lora_merge
#   workers  scripts/gpu_check_workers.py: every modality's worker on CUDA against CPU
#   swap     scripts/bench_swap.py on the demo models, then on a 1.6 GB chat model built here
#            from a config (random bf16 weights): cold load vs warm reload, judged on CUDA
#   decode   scripts/bench_decode.py: the chat engine's decode step with cuDNN out of attention
#            (as tiergate places models) against torch's own order (cuDNN first); then
#            scripts/bench_prefill.py: new prompts sharing prefill passes against a pass each
#   serving  only when named (STEPS=serving, ~8 min): scripts/bench_tiers.py and
#            scripts/bench_batch.py with the demo chat model on CUDA and the machine's cores,
#            where the load generators do not share two cores with the server
# Exit status: the number of steps that failed.
set -u
OUT=${1:-bench-results/gpu}
PY=${PY:-python3}
STEPS=${STEPS:-kernels lora workers swap decode}  # a subset reruns only those
SIZED_HIDDEN=${SIZED_HIDDEN:-2048}  # 16 layers of this width: 0.82 B parameters, 1.6 GB in bf16
mkdir -p "$OUT"
LOG="$OUT/all.log"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
WHEELS=${WHEELS:-.whl}  # wheels for what the machine lacks (installed into /tmp/site, first on PYTHONPATH)
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
failed=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    case " $STEPS " in *" ${name%%-*} "*) ;; *) return 0 ;; esac
    start=$(date +%s)
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | grep -v -e '^Loading' | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$LOG"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  echo "cores: $(nproc)"
  "$PY" -c "import sys, torch, triton, transformers, peft, diffusers
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__, 'peft', peft.__version__, 'diffusers', diffusers.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$LOG"

step kernels 150 "$PY" -m pytest --noconftest -p no:cacheprovider -q -rs tests/test_lora_kernels.py tests/test_footprint.py
step lora 150 "$PY" scripts/gpu_check_lora.py --out "$OUT"
step workers 90 "$PY" scripts/gpu_check_workers.py --out "$OUT"
step swap-demo 90 "$PY" scripts/bench_swap.py --models-dir demo-models --chat-engine transformers

SIZED=/tmp/tiergate-sized
case " $STEPS " in *" swap "*) ;; *) SIZED_HIDDEN=0 ;; esac
[ "$SIZED_HIDDEN" = 0 ] || timeout 90 "$PY" - "$SIZED" "$SIZED_HIDDEN" <<'EOF' 2>&1 | tee -a "$LOG"
import shutil, sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
out, hidden = Path(sys.argv[1]), int(sys.argv[2])
shutil.rmtree(out, ignore_errors=True)
shutil.copytree("demo-models/tiny-chat", out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=16, vocab_size=568, max_position_embeddings=2048,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
device = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(device):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.cpu().save_pretrained(out)
n = sum(p.numel() for p in model.parameters())
print(f"sized chat model: {n / 1e9:.2f} B parameters, {n * 2 / 1e9:.2f} GB in bf16, at {out}")
(out / "tiers.yaml").write_text(f"""tiers:
  - {{name: paid, keys_env: TIERGATE_KEYS_PAID, latency_target_s: 10}}
models:
  - {{name: sized-chat, kind: chat, path: {out}, engine: {{name: transformers}}}}
""")
EOF
step swap-sized 90 "$PY" scripts/bench_swap.py --config "$SIZED/tiers.yaml" --kinds chat --reps 5
step decode 120 "$PY" scripts/bench_decode.py
step decode-prefill 120 "$PY" scripts/bench_prefill.py --device cuda
step serving-tiers 330 "$PY" scripts/bench_tiers.py
step serving-batch 200 "$PY" scripts/bench_batch.py
echo "gpu_check: $failed step(s) failed" | tee -a "$LOG"
exit "$failed"
