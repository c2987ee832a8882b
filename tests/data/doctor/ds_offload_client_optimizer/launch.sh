# deepspeed.initialize with --deepspeed_config: the script passes its own optimizer (the file has
# none), and DeepSpeed refuses a client torch optimizer next to ZeRO-Offload (Megatron-DeepSpeed
# issue #298, bitsandbytes #596). accelerate and the HF Trainer map it to DeepSpeedCPUAdam instead.
deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json
