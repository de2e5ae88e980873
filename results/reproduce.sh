#!/usr/bin/env bash
# Regenerates every file in results/ (after `bash setup.sh`), one job after another on a quiet machine: the
# timings are only comparable when nothing else shares the cores. About an hour on the 2-core CPU machine (47 min
# before the precision set and bench_precision.py, which took ~10 and ~16 min on the AVX-512 machine).
# `bash results/reproduce.sh --check` trains nothing: it redraws the plots below from the committed files, checks
# every tagged figure of README.md, docs/, results/README.md and models/README.md against its source, and fails on a
# figure-like number without a tag in the files it sweeps (results/check_figures.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --check ]; then exec .venv/bin/python results/check_figures.py; fi
export HF_HUB_OFFLINE=1
launch=(.venv/bin/accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml)
# The configs write into runs/ (ignored by git); the committed results are written here explicitly, into results/.
tiny=(recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_cpu.yaml output_dir=results)
# Clear the earlier runs first: beside an earlier run's checkpoints (not committed) a new run would go to
# <run_name>-2 instead of replacing it.
rm -rf results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy results/precision \
       results/tiny-moe-cpu-merge results/trl-tiny-cpu results/tiny-cpu-attn-* results/tiny-cpu-server \
       results/trl-tiny-cpu-server results/tiny-cpu-server-async* results/tiny-cpu-tools* results/trl-tiny-cpu-tools \
       results/tiny-cpu-agent results/tiny-cpu-env-* results/tiny-cpu-long
"${launch[@]}" "${tiny[@]}"                                    # README's main command, written into results/
"${launch[@]}" "${tiny[@]}" lora.merge=false run_name=tiny-cpu-lora
"${launch[@]}" "${tiny[@]}" padding.legacy_slice=true max_steps=40 run_name=tiny-cpu-legacy
# the precision set: fp32 / bf16 / fp16 x merge on / off, 20 rollout steps each (results/precision/<dtype>-<mode>)
for dtype in float32 bfloat16 float16; do
  for merge in true false; do
    name="$(sed 's/^bfloat/bf/; s/^float/fp/' <<< "$dtype")-$([ "$merge" = true ] && echo merge || echo lora)"
    "${launch[@]}" "${tiny[@]}" model.dtype=$dtype lora.merge=$merge max_steps=80 output_dir=results/precision \
        run_name="$name"
  done
done
"${launch[@]}" recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_moe_cpu.yaml output_dir=results
# vllm.mode=server (docs/server.md): the main run's config with rollouts from a `vllm serve` on the same machine,
# in fp32 (results/tiny-cpu-server) and in bf16 as the precision set's runs (results/precision/bf16-server)
serve_tiny() {  # $1: the server's dtype, $2: its log's name, [$3: model, $4: max model length, $5: KV block size
  # (vLLM's CPU default: 128)]; the server's pid in $server once it answers
  if curl -sf http://127.0.0.1:8391/health > /dev/null; then echo "another server answers on port 8391" >&2; exit 1; fi
  VLLM_SERVER_DEV_MODE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server --model "${3:-cache/tiny-qwen3-gsm8k}" \
      --host 127.0.0.1 --port 8391 --dtype "$1" --enforce-eager --max-model-len "${4:-160}" \
      --kv-cache-memory-bytes 268435456 \
      --enable-scale-out --weight-transfer-config '{"backend": "lora_merge"}' --logprobs-mode processed_logprobs \
      --enable-prefix-caching --enable-prompt-tokens-details --max-num-batched-tokens 16384 \
      --block-size "${5:-128}" > "${TMPDIR:-/tmp}/$2.serve.log" 2>&1 &
  server=$!
  until curl -sf http://127.0.0.1:8391/health > /dev/null; do kill -0 $server; sleep 2; done
}
serve_tiny float32 tiny-cpu-server
"${launch[@]}" "${tiny[@]}" vllm.mode=server vllm.server_url=http://127.0.0.1:8391 run_name=tiny-cpu-server
# asynchronous rollouts (docs/async.md): the same run, the server generating up to 1 and 2 rollout steps ahead,
# with TRL's default correction (sequence_mask) and with AReaL's per-token truncated weights (token_truncate)
for staleness in 1 2; do
  "${launch[@]}" "${tiny[@]}" vllm.mode=server vllm.server_url=http://127.0.0.1:8391 max_staleness=$staleness \
      run_name=tiny-cpu-server-async$staleness
done
for staleness in 1 2; do
  "${launch[@]}" "${tiny[@]}" vllm.mode=server vllm.server_url=http://127.0.0.1:8391 max_staleness=$staleness \
      vllm_importance_sampling_mode=token_truncate run_name=tiny-cpu-server-async$staleness-token-truncate
done
kill $server; wait $server || true
serve_tiny bfloat16 bf16-server
"${launch[@]}" "${tiny[@]}" model.dtype=bfloat16 max_steps=80 output_dir=results/precision run_name=bf16-server \
    vllm.mode=server vllm.server_url=http://127.0.0.1:8391
kill $server; wait $server || true
"${launch[@]}" recipes/grpo_trl.py --config recipes/configs/trl_tiny_cpu.yaml --output_dir results
# TRL's server mode against a fresh lora_merge server (docs/trl.md): the factors only, each sync
serve_tiny float32 trl-tiny-cpu-server
"${launch[@]}" recipes/grpo_trl.py --config recipes/configs/trl_tiny_cpu_server.yaml --output_dir results \
    --vllm_server_base_url http://127.0.0.1:8391
kill $server; wait $server || true
# multi-turn tool use (docs/tools.md): token in / token out (colocated; it builds cache/tiny-qwen3-tools), the
# re-tokenized comparison, the same against a lora_merge server, and TRL's GRPOTrainer(tools=...) with the merged sync
tools=(recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_cpu_tools.yaml output_dir=results)
"${launch[@]}" "${tools[@]}"
"${launch[@]}" "${tools[@]}" tool_calling.retokenize=true run_name=tiny-cpu-tools-retokenized
serve_tiny float32 tiny-cpu-tools-server cache/tiny-qwen3-tools 192 32
"${launch[@]}" "${tools[@]}" vllm.mode=server vllm.server_url=http://127.0.0.1:8391 run_name=tiny-cpu-tools-server
# asynchronous tool episodes (docs/tools.md): the server runs the next rollout steps' episodes during the update
for staleness in 1 2; do
  "${launch[@]}" "${tools[@]}" vllm.mode=server vllm.server_url=http://127.0.0.1:8391 max_staleness=$staleness \
      run_name=tiny-cpu-tools-server-async$staleness
done
kill $server; wait $server || true
"${launch[@]}" recipes/grpo_trl.py --config recipes/configs/trl_tiny_cpu_tools.yaml --output_dir results
# the same task run by an agent that owns its loop, through the OpenAI-compatible endpoint (docs/agents.md)
"${launch[@]}" recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_cpu_agent.yaml output_dir=results
# long episodes: the key-chain task at 16 turns against its environment (docs/tools.md)
"${launch[@]}" recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_cpu_long.yaml output_dir=results
.venv/bin/python recipes/plot_tools.py results/tiny-cpu-tools results/tiny-cpu-tools-retokenized \
    results/tiny-cpu-tools-server results/tiny-cpu-tools-server-async{1,2} --out results/grpo_tools.png
# guess-the-number, a stateful environment (docs/environments.md): episode-level against turn-level credit, 3 seeds
env=(recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_cpu_env.yaml output_dir=results)
for seed in 0 1 2; do
  for mode in episode turn; do
    "${launch[@]}" "${env[@]}" advantage=$mode seed=$seed run_name=tiny-cpu-env-$mode-s$seed
  done
done
.venv/bin/python recipes/plot_env.py results/tiny-cpu-env-{episode,turn}-s{0,1,2} --out results/grpo_env.png
.venv/bin/python recipes/guess_policy.py results/tiny-cpu-env-{episode,turn}-s{0,1,2} --out results/grpo_env_policy.json
.venv/bin/python recipes/plot_metrics.py results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy \
    --out results/grpo_metrics.png
.venv/bin/python recipes/plot_metrics.py results/tiny-cpu-merge results/precision/bf16-merge results/precision/bf16-lora \
    results/tiny-moe-cpu-merge results/trl-tiny-cpu results/tiny-cpu-server --out results/grpo_variants.png
.venv/bin/python recipes/plot_metrics.py results/precision/{fp32,bf16,fp16}-{merge,lora} results/precision/bf16-server --out results/grpo_precision.png
.venv/bin/python bench/bench_rollout.py --sizes tiny small tiny-moe --out results/bench_rollout.json
.venv/bin/python bench/bench_sync.py --out results/bench_sync.json
.venv/bin/python bench/plot_bench.py results/bench_rollout.json results/bench_sync.json --out results/bench.png
.venv/bin/python recipes/plot_metrics.py results/tiny-cpu-server results/tiny-cpu-server-async{1,2} \
    results/tiny-cpu-server-async{1,2}-token-truncate --out results/grpo_async.png
.venv/bin/python bench/bench_async.py --out results/bench_async.json --timelines results/bench_async_timelines
.venv/bin/python recipes/plot_timeline.py results/bench_async_timelines/staleness{0,1,2} --steps 5 8 \
    --out results/timeline_async.png
# packed_sdpa (the default) against transformers' sdpa with its block-diagonal mask, one run after the other
"${launch[@]}" "${tiny[@]}" max_steps=48 eval_steps=null run_name=tiny-cpu-attn-packed
"${launch[@]}" "${tiny[@]}" max_steps=48 eval_steps=null model.attn_implementation=sdpa run_name=tiny-cpu-attn-sdpa
.venv/bin/python recipes/plot_metrics.py results/tiny-cpu-attn-packed results/tiny-cpu-attn-sdpa --out results/attention.png
.venv/bin/python -m grpo.memory_plan --config recipes/configs/qwen3_4b_gsm8k.yaml --qwen3-4b-shape --world 1 8 \
    > results/memory_plan_qwen3_4b.txt
.venv/bin/python -m grpo.memory_plan --config recipes/configs/qwen3_4b_gsm8k_24gb.yaml --qwen3-4b-shape --world 1 \
    --device-gib 22.35 > results/memory_plan_qwen3_4b_24gb.txt
# the update phase's log-probs: full-vocabulary logits vs the LM head on response rows in chunks (memory, time)
.venv/bin/python bench/bench_logprobs.py --out results/bench_logprobs.json
# merged vs adapter vs trainer in bf16 and fp16 against fp32 W + delta, over update sizes (Qwen3-4B's shape, 26.5M)
.venv/bin/python bench/bench_precision.py --out results/bench_precision.json
.venv/bin/python bench/plot_precision.py results/bench_precision.json --out results/bench_precision.png
# server mode: lora_merge vs full merged weights vs vLLM LoRA per sync, and the server's rollout tokens/s
.venv/bin/python bench/bench_server.py --out results/bench_server.json
# multi-turn rollouts with the server's prefix cache on and off (docs/tools.md)
.venv/bin/python bench/bench_tool_cache.py --out results/bench_tool_cache.json
.venv/bin/python bench/bench_tool_cache.py --out results/bench_tool_cache_small.json --random-size small --turns 8 16 32
.venv/bin/python bench/bench_tool_schedule.py --out results/bench_tool_schedule.json
# exact at length: per-turn |vLLM - trainer| and sequence-level weights of key-chain episodes of 16 to 100 turns
.venv/bin/python bench/bench_long_fidelity.py --out results/bench_long_fidelity.json
# the trainer at length: packed forward + backward up to max_model_len (time, memory), the episode loop up to 100 turns
.venv/bin/python bench/bench_long_trainer.py --out results/bench_long_trainer.json --sizes tiny
.venv/bin/python bench/bench_long_trainer.py --out results/bench_long_trainer_small.json --sizes small --repeats 2 --turns 16 \
    --episodes 2 --parsers auto
# what seeding every request costs vLLM's V1 sampler (docs/gpus.md)
.venv/bin/python bench/bench_seeding.py --out results/bench_seeding.json
