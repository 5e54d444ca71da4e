"""Image data for vision-language tasks: box formats and metrics, dataset readers, contact sheets.

* :mod:`emdlm.vision.boxes`: box geometry (parse, IoU), answer box formats (Qwen2-VL grid, LLaVA
  fractions), reading order, several-box matching metrics.
* :mod:`emdlm.vision.readers`: RefCOCO / RefCOCO+ / RefCOCOg, ICDAR2015, MSRA-TD500 and
  clock-image folders in their own on-disk formats, as rows ``{image, prompt, completion, ...}``.
* :mod:`emdlm.vision.images`: every image on its way to the model: one RGB conversion (EXIF
  orientation, 16-bit, alpha on white, ...) and one up-front check that decodes it in full.
* :mod:`emdlm.vision.contact_sheet`: a PNG grid of test images with gold and predicted answers.
"""
