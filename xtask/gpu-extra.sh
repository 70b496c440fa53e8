#!/usr/bin/env bash
# xtask/gpu-extra.sh: the steps of `cargo xtask gpu-check` that the GPU bundle's run.sh does
# not run itself (or not as gpu-check does), from the bundle's prebuilt binaries, for a GPU
# machine without cargo. It runs as run.sh's COMMAND, after the step that makes the
# synthetic sample:
#
#   GPU_BUNDLE_BUDGET_S=480 bash .gpu-bundle/run.sh probe nccl-sys sample -- 'bash xtask/gpu-extra.sh'
#
# (from the checkout's root; give the call a limit of about 540 s). run.sh's other steps are
# left out, so that the budget goes to these checks: `comm` runs ddp-comm's NCCL tests all at
# once, each test's ranks sharing the GPU with the others', which spoils the tests that time
# queued work against a collective (`comm-29` and `comm` below run them one at a time);
# `train` would repeat `train-*` below; `sweep` and `random` measure nothing
# issue 29 needs. The bundle must hold the binaries gpu-bundle.list names.
# Checks, in this order (issue 29's first, then the figure it asks for), each under its own
# time limit, one test at a time (--test-threads=1):
#   comm-29    ddp-comm's NCCL tests of issue 29, by exact name (COMM_29 below): waits after
#              an abort, a dropped Work's temporary, the current stream, blocking collectives
#              and stream-side waits, the watchdog, CUDA's error slot after polling
#   peers      a group dropped with a collective pending is aborted (two GPUs; SKIP on one)
#   units      ddp-train's unit tests with a CUDA variant (ddp-train.lib, filtered as
#              DDP_TRAIN_GPU_UNIT_TESTS in gpu_check.rs): the fused fp16 unscale on cuda:0
#              equals the per-parameter one; clipping equals the CPU's; a step's values
#              come back from cuda:0 in one read; neither a compress hook's copy nor a dropped
#              bucket is reused before the syncing stream has read it
#   streams    DDP on a pool stream behind queued work against the default stream (one rank
#              per GPU; with one GPU the path runs, and sync_gradients must return while
#              that work still runs), and SyncBatchNorm's all-reduces leave the host free
#   loader     ddp-data's CUDA tests: batches on cuda:0 equal the CPU path's, also on a pool
#              stream; a GPU busy for five batches' decoding per step stalls no worker (the
#              median data wait is printed)
#   resnet50-fp16
#              ResNet-50 on random tensors, batch 64, 224 px, GradScaler with the fused
#              unscale; FAIL when rank 0's loss is not finite or more than MAX_SKIPPED_STEPS
#              steps were skipped for overflowing gradients
#   shim       tch-ext's CUDA tests (streams, events, hooks on CUDA parameters)
#   comm       the rest of ddp-comm's NCCL tests (tests/nccl.rs)
#   resnet50-bf16
#              as resnet50-fp16, in bf16 (no scaler)
#   feed       the ConvNet fed by the CUDA loader from 256 synthetic 512-px JPEGs
#              (ddp_steps --data; data_median_s is the data wait per step)
#   train-bf16, train-fp16, train-fp32
#              ddp-train on cuda:0 on the synthetic sample, 2 epochs of at most 30 steps,
#              so that an epoch's end (its checkpoint, the scaler's state) runs on CUDA
#   torch-resnet50-fp16, torch-resnet50-bf16
#              PyTorch's DDP doing the resnet50 checks' work (reference_ddp.py), and
#              ours/PyTorch: a figure beside ours, last, so that it neither judges nor
#              delays them
#
# Writes $OUT/extra.txt (a line per check: name, status, rc, seconds, figure) and
# $OUT/extra-log.txt (every command and its whole output); prints extra.txt last. Statuses:
# ok, FAIL, TIMEOUT, NOT-RUN (the time left was too short to start it), NO-GPU (a test said
# `skipped:` where a GPU was needed; a skip that says it needs two GPUs is expected on one,
# as `cargo xtask gpu-check` reads it), SKIP (a check that needs two GPUs on one, or a
# binary is missing). Exit code: the number of FAIL, TIMEOUT, NOT-RUN and NO-GPU lines of our
# checks (the torch-* rows are figures: their status is shown, not counted).
#
# Time: each check's limit is cut to what is left of run.sh's budget for this command (read
# from the header of run.sh's summary.txt, else GPU_EXTRA_BUDGET_S seconds from the start,
# else GPU_BUNDLE_BUDGET_S), and when run.sh's own limit stops this script (SIGTERM), the
# running check, its process group (ranks included), is killed with it instead of holding
# the GPU past the end of run.sh.
#
# GPU_BUNDLE_SIMULATE_CPU=1 (as for run.sh) runs the same checks on the CPU with tiny sizes:
# it tests this script and measures nothing.

set -u

BIN=${GPU_BUNDLE_BIN:?"run this through the bundle: GPU_BUNDLE_BUDGET_S=480 bash .gpu-bundle/run.sh probe nccl-sys sample -- 'bash xtask/gpu-extra.sh'"}
OUT=${OUT:?"OUT (the output folder) is not set: run this through .gpu-bundle/run.sh"}
PY=${GPU_BUNDLE_PYTHON:-python3}
WORK=${GPU_BUNDLE_WORK:-$(mktemp -d)}
SUMMARY=$OUT/extra.txt
LOG=$OUT/extra-log.txt
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
BAD=0
NOT_RUN=0
KILL_AFTER=10 # seconds from a check's TERM to its KILL
MIN_CHECK_S=20
# The most steps (of 45) a mixed-precision ResNet-50 run may skip for overflowing gradients:
# MAX_SKIPPED_STEPS in xtask/src/gpu_check.rs, whose test holds the two equal.
MAX_SKIPPED_STEPS=5
: >"$SUMMARY"
: >"$LOG"

# When this script must end (seconds since the epoch), or empty: run.sh gives the command
# what is left of its budget, less 5 s, and writes the elapsed time in its summary's header
# just before starting it.
DEADLINE=""
now_s=$(date +%s)
if [[ -n ${GPU_EXTRA_BUDGET_S:-} ]]; then
    DEADLINE=$((now_s + GPU_EXTRA_BUDGET_S))
elif read -r elapsed budget < <(sed -nE 's/^elapsed ([0-9]+)s of a ([0-9]+)s budget; INCOMPLETE: was running command$/\1 \2/p' "$OUT/summary.txt" 2>/dev/null); then
    DEADLINE=$((now_s + budget - elapsed - 5))
elif [[ -n ${GPU_BUNDLE_BUDGET_S:-} ]]; then
    DEADLINE=$((now_s + GPU_BUNDLE_BUDGET_S))
fi

row() { # row NAME STATUS RC SECONDS FIGURE
    printf '%-20s %-8s %4s %6s  %s\n' "$1" "$2" "$3" "$4" "$5" | tee -a "$SUMMARY"
    case $1 in torch-*) return ;; esac
    case $2 in FAIL | TIMEOUT | NOT-RUN | NO-GPU) BAD=$((BAD + 1)) ;; esac
}

summary() {
    echo
    echo "=== gpu-extra summary ($SUMMARY)"
    cat "$SUMMARY"
}

# run.sh's time limit ends this script with SIGTERM (and SIGKILL 5 s later). `timeout`
# gives each check a process group of its own, which that signal does not reach: kill it
# here, so that nothing of it keeps the GPU after run.sh has finished.
CHECK_PID=""
CHECK_NAME=""
on_signal() {
    trap - TERM INT HUP
    if [[ -n $CHECK_PID ]]; then
        # `timeout` passes the TERM on to its process group; the KILL is for what ignores it.
        kill -TERM "$CHECK_PID" 2>/dev/null
        kill -TERM -- "-$CHECK_PID" 2>/dev/null
        sleep 2
        kill -KILL -- "-$CHECK_PID" 2>/dev/null
        row "$CHECK_NAME" TIMEOUT - - "killed with gpu-extra.sh (run.sh's time limit)"
    fi
    summary
    exit 124
}
trap on_signal TERM INT HUP

# check NAME LIMIT_S CMD...: runs CMD under `timeout`, its output into $LOG and $STEP_OUT;
# the limit is cut to the time left before DEADLINE. Sets RC, SECS and NOT_RUN (1: too
# little time was left to start it).
check() {
    local name=$1 limit=$2 start ms left
    shift 2
    STEP_OUT=$WORK/extra-$name.out
    NOT_RUN=0
    if [[ -n $DEADLINE ]]; then
        left=$((DEADLINE - $(date +%s) - KILL_AFTER - 2))
        if ((left < MIN_CHECK_S)); then
            NOT_RUN=1 RC=124 SECS=0.0
            echo "not run: ${left}s left of the time budget" >"$STEP_OUT"
            printf '\n=== %s: not run, %ss left of the time budget\n' "$name" "$left" >>"$LOG"
            return
        fi
        ((limit > left)) && limit=$left
    fi
    start=$(date +%s%N)
    printf '\n=== %s (limit %ss): %s\n' "$name" "$limit" "$*" >>"$LOG"
    # In the background, so that a TERM to this script is handled at once (bash runs a trap
    # only between commands, and `wait` is one).
    CHECK_NAME=$name
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$STEP_OUT" 2>&1 </dev/null &
    CHECK_PID=$!
    wait "$CHECK_PID"
    RC=$?
    CHECK_PID=""
    ms=$((($(date +%s%N) - start) / 1000000))
    SECS=$((ms / 1000)).$((ms % 1000 / 100))
    cat "$STEP_OUT" >>"$LOG"
    printf '=== %s: rc %s, %ss\n' "$name" "$RC" "$SECS" >>"$LOG"
}

# The last check's `skipped:` lines that this machine does not explain. A test that needs two
# GPUs says so when it skips (`needs two GPUs`, tch-ext's `needs 2 CUDA devices`): with one
# GPU that skip is expected, as `cargo xtask gpu-check` reads it (TWO_GPU_SKIPS there).
unexpected_skips() {
    if ((GPUS < 2)); then
        grep 'skipped:' "$STEP_OUT" | grep -v -e 'needs two GPUs' -e 'needs 2 CUDA'
    else
        grep 'skipped:' "$STEP_OUT"
    fi
}

status() { # status [NEED_GPUS]: the last check's; only expected skips, with fewer GPUs than needed, is SKIP
    if ((NOT_RUN)); then
        echo NOT-RUN
    elif ((RC == 124 || RC == 137)); then
        echo TIMEOUT
    elif ((RC != 0)); then
        echo FAIL
    elif grep -qE 'test result: [a-zA-Z]+\. 0 passed' "$STEP_OUT"; then
        echo FAIL # a filter that names no test runs none, and libtest says ok
    elif [[ -n $(unexpected_skips) ]]; then
        echo NO-GPU
    elif grep -q 'skipped:' "$STEP_OUT" && ((${1:-1} > GPUS)); then
        echo SKIP
    else
        echo ok
    fi
}

why_not() { # why_not FIGURE: FIGURE, or why the last check was not run
    if ((NOT_RUN)); then cat "$STEP_OUT"; else printf '%s' "$1"; fi
}

# precision_verdict: the last ResNet-50 run's status and a note: FAIL when rank 0's loss is
# not finite or more than MAX_SKIPPED_STEPS steps were skipped for overflowing gradients.
precision_verdict() {
    local line loss skipped
    VERDICT=$(status) VERDICT_NOTE=""
    [[ $VERDICT == ok ]] || return
    line=$(grep -m1 -E '^RESULT ddp_steps .* rank=0 ' "$STEP_OUT")
    loss=$(grep -oE ' loss=[^ ]+' <<<"$line" | cut -d= -f2)
    skipped=$(grep -oE ' skipped_steps=[0-9]+' <<<"$line" | cut -d= -f2)
    if [[ -z $line ]]; then
        VERDICT=FAIL VERDICT_NOTE="no RESULT line of rank 0; "
    elif [[ ! $loss =~ ^-?[0-9]+(\.[0-9]+)?$ ]]; then
        VERDICT=FAIL VERDICT_NOTE="the loss is ${loss:-missing}; "
    elif [[ -z $skipped ]] || ((skipped > MAX_SKIPPED_STEPS)); then
        VERDICT=FAIL VERDICT_NOTE="${skipped:-?} steps skipped, more than $MAX_SKIPPED_STEPS; "
    fi
}

tests_figure() { # "N passed, M failed" from libtest's result line, and the first skip reason
    local r
    r=$(grep -oE 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "$STEP_OUT" | tail -1 | sed 's/test result: [a-zA-Z]*\. //')
    grep -q 'skipped:' "$STEP_OUT" && r+="; $(grep -m1 -o 'skipped:.*' "$STEP_OUT" | head -c 120)"
    echo "${r:-no test result; $(grep -v '^\s*$' "$STEP_OUT" | tail -1 | head -c 160)}"
}

run_test() { # run_test NAME BINARY NEED_GPUS [ARG...]: ARGs go before libtest's own
    local name=$1 bin=$BIN/$2 need=$3
    shift 3
    if [[ ! -x $bin ]]; then
        row "$name" SKIP - 0.0 "no ${bin##*/} in the bundle (gpu-bundle.list names it; rebuild the bundle)"
        return
    fi
    check "$name" 180 "$bin" "$@" --nocapture --test-threads=1
    local fig
    fig=$(tests_figure)
    local wait
    wait=$(grep -m1 -oE 'data wait per step: median [0-9.]+ ms[^)]*\)' "$STEP_OUT" | head -c 160)
    [[ -n $wait ]] && fig+="; $wait"
    # ddp-comm's figure: the host's time to queue a one-element all_reduce_async.
    wait=$(grep -m1 -oE 'all_reduce_async enqueue: median [0-9.]+ us, p90 [0-9.]+ us' "$STEP_OUT")
    [[ -n $wait ]] && fig+="; $wait"
    row "$name" "$(status "$need")" "$RC" "$SECS" "$(why_not "$fig")"
}

result_figure() { # rank 0's rate and phases
    grep -m1 -E '^RESULT ddp_steps .* rank=0 ' "$STEP_OUT" |
        grep -oE ' (images_per_sec|step_median_s|data_median_s|loss|loss_scale|skipped_steps)=[^ ]+' | tr -d '\n'
}

DEV=cuda images=256 feed_px=512 px=224 train_steps=30 batch=64
steps_args=(--ranks 1 --batch-size 64 --warmup 5 --steps 40)
if [[ ${GPU_BUNDLE_SIMULATE_CPU:-0} == 1 ]]; then
    DEV=cpu images=16 feed_px=64 px=64 train_steps=2 batch=4
    steps_args=(--ranks 1 --batch-size 4 --warmup 1 --steps 2)
    echo "gpu-extra: GPU_BUNDLE_SIMULATE_CPU=1: a CPU dry run of this script, NOT a GPU check" | tee -a "$LOG"
fi
steps_args+=(--device "$DEV")
steps=$BIN/ddp-train.bench.ddp_steps

# ddp-comm's NCCL tests (tests/nccl.rs) of issue 29, run first and by exact name, so that a
# hang in another test cannot leave them unrun (tests/gpu_extra.rs checks each name exists).
COMM_29=(
    nccl_a_wait_after_an_abort_is_an_error
    nccl_a_dropped_work_keeps_its_temporary
    nccl_collectives_follow_the_current_stream
    nccl_a_blocking_collective_waits_for_its_input_only
    nccl_wait_stream_makes_the_current_stream_wait
    nccl_the_watchdog_aborts_a_collective_only_a_stream_waits_for
    nccl_polling_a_busy_collective_leaves_no_cuda_error_behind
)
skip_29=()
for t in "${COMM_29[@]}"; do skip_29+=(--skip "$t"); done

unit_tests() {
    if [[ ! -x $BIN/ddp-train.lib ]]; then
        row units SKIP - 0.0 "no ddp-train.lib in the bundle (gpu-bundle.list: lib ddp-train; rebuild the bundle)"
        return
    fi
    check units 180 "$BIN/ddp-train.lib" amp::tests::the_fused_unscale_equals_the_per_parameter_one_in_one_flag_on_cuda \
        amp::tests::the_fused_unscale_leaves_the_host_free_on_cuda \
        optim::tests::clipping_on_cuda_equals_clipping_on_the_cpu \
        trainer::reads::tests::values_of_every_shape_and_kind_come_back_in_order_on_cuda \
        ddp::comm_hook::tests:: ddp::bucket::tests::a_dropped_bucket_keeps_its_memory_until_the_dropping_stream_has_read_it \
        --nocapture --test-threads=1
    row units "$(status 1)" "$RC" "$SECS" "$(why_not "$(tests_figure)")"
}

# resnet50 PRECISION: ours alone, judged by precision_verdict; its rate is kept for the
# comparison with PyTorch at the end.
declare -A OURS_RATE=()
resnet50() {
    local p=$1
    if [[ ! -x $steps ]]; then
        row "resnet50-$p" SKIP - 0.0 "no ddp-train.bench.ddp_steps in the bundle"
        return
    fi
    check "resnet50-$p" 180 "$steps" "${steps_args[@]}" --image-size "$px" --precision "$p" --model resnet50
    precision_verdict
    OURS_RATE[$p]=$(grep -m1 -E '^RESULT ddp_steps .* rank=0 ' "$STEP_OUT" | grep -oE ' images_per_sec=[0-9.]+' | cut -d= -f2)
    row "resnet50-$p" "$VERDICT" "$RC" "$SECS" "$(why_not "$VERDICT_NOTE$(result_figure)")"
}

feed() {
    if [[ ! -x $steps || ! -x $BIN/ddp-gen-data ]]; then
        row feed SKIP - 0.0 "no ddp_steps bench or ddp-gen-data in the bundle"
        return
    fi
    check feed-sample 120 "$BIN/ddp-gen-data" --out "$WORK/feed" --images "$images" --size "$feed_px" --seed 0
    if ((RC != 0)); then
        row feed "$(status)" "$RC" "$SECS" "$(why_not "generating the sample failed: $(tail -1 "$STEP_OUT" | head -c 160)")"
        return
    fi
    check feed 180 "$steps" "${steps_args[@]}" --data "$WORK/feed"
    row feed "$(status)" "$RC" "$SECS" "$(why_not "$(result_figure)")"
}

trainings() {
    if [[ -z ${GPU_BUNDLE_SAMPLE:-} || ! -x $BIN/ddp-train ]]; then
        row train SKIP - 0.0 "no synthetic sample (name run.sh's sample step before --) or no ddp-train"
        return
    fi
    local p port
    for p in bf16 fp16 fp32; do
        port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        check "train-$p" 120 env WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
            MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" "$BIN/ddp-train" --device "$DEV" \
            --data "$GPU_BUNDLE_SAMPLE" --epochs 2 --max-steps-per-epoch "$train_steps" \
            --image-size 128 --batch-size "$batch" --precision "$p" --out "$WORK/run-$p"
        row "train-$p" "$(status)" "$RC" "$SECS" "$(why_not "$(grep -E '^epoch [0-9]+/[0-9]+: ' "$STEP_OUT" | tail -1 | head -c 200)")"
    done
}

# torch_resnet50 PRECISION: PyTorch's DDP on resnet50 PRECISION's work, and ours/PyTorch.
torch_resnet50() {
    local p=$1 line theirs ours=${OURS_RATE[$1]:-} fig
    check "torch-resnet50-$p" 120 "$PY" ddp-train/benches/reference_ddp.py "${steps_args[@]}" \
        --image-size "$px" --precision "$p" --model resnet50
    line=$(grep -m1 -E '^RESULT reference_ddp .* rank=0 ' "$STEP_OUT")
    theirs=$(grep -oE ' images_per_sec=[0-9.]+' <<<"$line" | cut -d= -f2)
    fig="PyTorch ${theirs:-?} img/s$(grep -oE ' (loss|skipped_steps)=[^ ]+' <<<"$line" | tr -d '\n')"
    if [[ -n $theirs && -n $ours ]]; then
        fig+="; ours $ours img/s, ours/PyTorch $(awk -v a="$ours" -v b="$theirs" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "?" }')"
    fi
    ((RC != 0)) && fig+="; $(grep -v '^\s*$' "$STEP_OUT" | tail -1 | head -c 160)"
    row "torch-resnet50-$p" "$(status)" "$RC" "$SECS" "$(why_not "$fig")"
}

echo "gpu-extra: $GPUS GPU(s); bundle binaries in $BIN; writing $SUMMARY; ${DEADLINE:+$((DEADLINE - $(date +%s)))s left}" | tee -a "$LOG"
run_test comm-29 ddp-comm.test.nccl 1 --exact "${COMM_29[@]}"
run_test peers ddp-comm.test.nccl_peers 2
unit_tests
run_test streams ddp-train.test.cuda_streams 1
run_test loader ddp-data.test.tensor 1
resnet50 fp16
run_test shim tch-ext.test.cuda 1
run_test comm ddp-comm.test.nccl 1 --exact "${skip_29[@]}"
resnet50 bf16
feed
trainings
for p in fp16 bf16; do torch_resnet50 "$p"; done

summary
exit "$BAD"
