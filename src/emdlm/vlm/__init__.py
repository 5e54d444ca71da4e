"""Vision-language models: tiny VLM builders and local image-text-to-text folders
(:mod:`emdlm.vlm.models`), the image+text collator (:mod:`emdlm.vlm.collator`), image rows
checked before training (:mod:`emdlm.vlm.data`) and generation with images
(:mod:`emdlm.vlm.generate`)."""
