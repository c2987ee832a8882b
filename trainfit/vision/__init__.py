"""Vision-language models: the `preset:vlm-tiny` architecture, image processors, chat rows with images,
freezing rules and the planner's image figures.

The code paths are those of transformers' image-text-to-text models (`AutoModelForImageTextToText`,
`AutoProcessor`), shaped on the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): an image becomes
`<|vision_start|>` + n x `<|image_pad|>` + `<|vision_end|>` in the token sequence, n fixed by the
image size and the processor's pixel limits (images.py).
"""

from __future__ import annotations
