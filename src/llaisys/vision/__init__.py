"""vision: image input for vision-language models."""
