# part `ppo` of bench/gpu_run.sh (sourced): a PPO timing run                  -> OUT/ppo.json
#   ppo      140 / 90   fastrlhf ppo on qwen2-0.5b, LoRA, bf16 (dry run: the tiny model on CPU)
if [ "$DRY" = 1 ]; then
  L_PPO=90
  PPO_ARGS=(--model tiny --device cpu --steps 2 --rollout_batch_size 8 --mini_batch_size 4 --micro_batch_size 2
            --max_new_tokens 8 --lora_rank 4 --eval_prompts 8)
else
  L_PPO=140
  PPO_ARGS=(--model qwen2-0.5b --device cuda --dtype bfloat16 --steps 3 --rollout_batch_size 64 --mini_batch_size 32
            --micro_batch_size 16 --max_new_tokens 256 --lora_rank 16 --eval_prompts 16)
fi
PPO_ARGS+=(--reward fastrlhf.train.task:true_score --out "$WORK/ppo_run" --save_every 1000)
step ppo "$L_PPO" 3 "$PY" -m fastrlhf ppo "${PPO_ARGS[@]}"
"$PY" bench/gpu_record.py ppo "$WORK/ppo_run" "$OUT/ppo.json" --command "fastrlhf ppo ${PPO_ARGS[*]}"
