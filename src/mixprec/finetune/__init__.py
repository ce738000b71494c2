"""Fine-tuning quantized models (`mixprec finetune`): QAT layers whose eval forward is the served
checkpoint's forward (qat.py), LoRA layers for peft over the quantized inference Linears (lora.py), and
the loop around the one training step with its verdict against the post-training checkpoints."""
