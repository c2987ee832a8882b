# source: https://github.com/huggingface/trl/blob/00bb368845b6bc85d13e4881bc7fe230a25f119a/trl/scripts/dpo.py (the LoRA command in its docstring)
# licence: Apache-2.0 (huggingface/trl); the command kept unchanged below this header as a test fixture.
python trl/scripts/dpo.py \
    --dataset_name trl-lib/ultrafeedback_binarized \
    --dataset_streaming \
    --model_name_or_path Qwen/Qwen2-0.5B-Instruct \
    --learning_rate 5.0e-6 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 2 \
    --gradient_accumulation_steps 8 \
    --gradient_checkpointing \
    --logging_steps 25 \
    --eval_strategy steps \
    --eval_steps 50 \
    --output_dir Qwen2-0.5B-DPO \
    --no_remove_unused_columns \
    --use_peft \
    --lora_r 32 \
    --lora_alpha 16
    --report_to wandb
