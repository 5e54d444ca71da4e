"""Vision-language models: tiny VLM builders and local image-text-to-text folders
(:mod:`emdlm.vlm.models`), the image+text collator (:mod:`emdlm.vlm.collator`) and generation
with images (:mod:`emdlm.vlm.generate`). Image rows are checked by
:mod:`emdlm.datasets.image_rows`; the VLM recipe is :mod:`emdlm.training.image_text`."""
