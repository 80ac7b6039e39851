#!/usr/bin/env bash
# train_gpt_test.sh - examples/train_gpt.c's checkpoints from outside: a
# checkpoint of another model, a truncated or garbage file, a step past
# --steps, a missing optimizer file and a missing text are refused with a
# message naming the problem (exit 1), never a crash; a good one resumes.
# usage: train_gpt_test.sh PATH_TO_train_gpt TEXT
set -uo pipefail
bin=$1
text=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/kiln-train-gpt.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "train_gpt_test: $*" >&2; cat "$work/err" >&2 2>/dev/null; exit 1; }
small=(--layers 1 --d-model 16 --heads 2 --seq 16 --batch 2 --print-every 100)

"$bin" "$text" "${small[@]}" --steps 4 --save "$work/ck" >"$work/out" 2>"$work/err" ||
	fail "saving a checkpoint failed"
[[ -s $work/ck && -s $work/ck.optim ]] || fail "no checkpoint files"
"$bin" "$text" "${small[@]}" --steps 6 --resume "$work/ck" >"$work/out" 2>"$work/err" ||
	fail "resuming failed"
grep -q 'steps 4 to 6' "$work/out" || fail "the resumed run did not start at step 4"

refused() { # refused PATTERN ARGS...: exit 1 and PATTERN on stderr
	local pat=$1 rc=0
	shift
	"$bin" "$@" >"$work/out" 2>"$work/err" || rc=$?
	((rc == 1)) || fail "exit $rc (want 1) for: $*"
	grep -Eq -e "$pat" "$work/err" || fail "no '$pat' for: $*"
}
refused "wte.weight in .* is f32 \[256, 16\], this model's f32 \[256, 32\]" \
	"$text" --layers 1 --d-model 32 --heads 2 --seq 16 --batch 2 --steps 6 --resume "$work/ck"
refused "holds 17 tensors; this model has 28" \
	"$text" --layers 2 --d-model 16 --heads 2 --seq 16 --batch 2 --steps 6 --resume "$work/ck"
refused "train.step must be one i64 in \[0, 3\]" "$text" "${small[@]}" --steps 3 --resume "$work/ck"
head -c 200 "$work/ck" >"$work/trunc"
cp "$work/ck.optim" "$work/trunc.optim"
refused "--resume: .*trunc" "$text" "${small[@]}" --steps 6 --resume "$work/trunc"
head -c 300 /dev/urandom >"$work/junk"
refused "--resume: .*junk" "$text" "${small[@]}" --steps 6 --resume "$work/junk"
cp "$work/ck" "$work/noopt"
refused "--resume: .*noopt\.optim" "$text" "${small[@]}" --steps 6 --resume "$work/noopt"
refused "cannot open $work/none" "$work/none" "${small[@]}"
refused "needs at least" "$text" --seq 100000
echo "train_gpt_test: ok"
