# Issue 15's GPU tests: the bitmask op launches nothing that synchronizes (torch's sync debug mode 'error'), the
# staged masks on the GPU equal each matcher's own, the bitmask kernel equals its definition (bf16/fp16/fp32);
# then the per-call pageable copy the op made before the fix run
# under the same mode, to show the test would have caught it. R: the results folder; DRY=1: the CPU selection;
# GUIDED_TESTS_S: the pytest bound (default 40 s).
set -u
R=${R:-/tmp/guided-results}
mkdir -p "$R"
MARK=(-m gpu); [ "${DRY:-0}" = 1 ] && MARK=()
timeout "${GUIDED_TESTS_S:-40}" python3 -m pytest -q -p no:cacheprovider -p no:warnings "${MARK[@]}" tests/test_kernels_token_bitmask.py \
  tests/test_guided_step.py -k "synchronizes or staged_masks or kernel" \
  > "$R/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$R/gpu_tests.txt"
[ "${DRY:-0}" = 1 ] || timeout 8 python3 - >> "$R/gpu_tests.txt" 2>&1 <<'PY'
import torch
from stoker.engine.kernels.token_bitmask import _BIT_OF_BYTE
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    _BIT_OF_BYTE.to(torch.device("cuda"))  # what apply_token_bitmask did on every call before the fix
    print("old per-call table copy: no error under sync debug mode")
except RuntimeError as e:
    print("old per-call table copy raises under sync debug mode:", str(e).splitlines()[0][:120])
finally:
    torch.cuda.set_sync_debug_mode(0)
PY
tail -4 "$R/gpu_tests.txt"
