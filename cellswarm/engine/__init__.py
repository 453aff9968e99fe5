

PREFILL_CHUNK = 512  # tokens per prefill step: bounds scratch memory for long prompts
