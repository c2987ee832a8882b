# source: https://github.com/huggingface/trl/blob/04f40dc78b82152c3afa5007ba3086c0fc377678/trl/scripts/sft.py (the LoRA command in its docstring)
# licence: Apache-2.0 (huggingface/trl); the command kept unchanged below this header as a test fixture.
python trl/scripts/sft.py \
    --model_name_or_path Qwen/Qwen2-0.5B \
    --dataset_name trl-lib/Capybara \
    --learning_rate 2.0e-4 \
    --num_train_epochs 1 \
    --packing \
    --per_device_train_batch_size 2 \
    --gradient_accumulation_steps 8 \
    --gradient_checkpointing \
    --eos_token '<|im_end|>' \
    --eval_strategy steps \
    --eval_steps 100 \
    --use_peft \
    --lora_r 32 \
    --lora_alpha 16 \
    --output_dir Qwen2-0.5B-SFT \
    --push_to_hub
