"""`preset:vlm-tiny`: a random-init Qwen3-VL with a tiny vision tower, trainfit's local tokenizer plus
the Qwen-VL vision tokens, and a Qwen2-VL image processor configured here. Nothing is downloaded.

Why Qwen3-VL: it is the architecture of the computer-use target (Qwen3-VL-8B), so the preset runs the
same modules (patch embedding, 2-D rotary vision blocks, the patch merger, DeepStack mergers feeding
vision features into early decoder layers, M-RoPE in the decoder). Its image processor is the
Qwen2-VL one; transformers picks the Pillow backend (`Qwen2VLImageProcessorPil`) when torchvision is
missing. transformers' `Qwen3VLProcessor` cannot be built without torchvision (its video processor
needs it), so trainfit pairs the image processor with the tokenizer itself (images.VisionProcessor).
"""

from __future__ import annotations

from trainfit.models.tokenizer import TOKENIZER_VOCAB, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Tiny numbers: a decoder like preset:tiny, a 2-block vision tower. patch 16 x merge 2: one image
# token per 32 x 32 pixels. head_dim 16 -> the decoder's rotary has 8 frequency pairs, split over
# (time, height, width) by mrope_section (sums to head_dim / 2).
VLM_PRESETS: dict[str, dict] = {
    "vlm-tiny": dict(
        text=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                    deepstack_visual_indexes=[0]),
        mrope_section=[2, 3, 3],
        # Pixel limits of the image processor: 64 x 64 .. 256 x 256 pixels = 4 .. 64 image tokens.
        min_pixels=64 * 64, max_pixels=256 * 256,
    ),
}


def is_vlm_preset(key: str) -> bool:
    return key in VLM_PRESETS


def build_vlm_tokenizer():
    """trainfit's local tokenizer (presets.build_tokenizer) with the four Qwen-VL vision tokens added
    as special tokens (ids 512..515)."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def vlm_config(key: str, vocab_size: int):
    """The transformers `Qwen3VLConfig` of a VLM preset; `vocab_size` = len(tokenizer)."""
    from transformers import Qwen3VLConfig

    arch = VLM_PRESETS[key]
    ids = {t: _vision_token_id(t) for t in VISION_TOKENS}
    text = dict(arch["text"], vocab_size=vocab_size, rms_norm_eps=1e-6, attention_dropout=0.0,
                eos_token_id=2, pad_token_id=0, bos_token_id=None,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     mrope_section=list(arch["mrope_section"]), mrope_interleaved=True))
    vision = dict(arch["vision"], out_hidden_size=arch["text"]["hidden_size"])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _vision_token_id(token: str) -> int:
    # add_special_tokens appends after the 512 BPE ids, in VISION_TOKENS order (build_vlm_tokenizer).

    return TOKENIZER_VOCAB + VISION_TOKENS.index(token)


def vlm_image_processor(key: str):
    """The preset's image processor: Qwen2-VL's, Pillow backend, with the preset's patch numbers and
    pixel limits (model.min_pixels / max_pixels replace the limits later, images.apply_pixel_limits)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    arch = VLM_PRESETS[key]
    v = arch["vision"]
    return Qwen2VLImageProcessorPil(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                                    temporal_patch_size=v["temporal_patch_size"],
                                    min_pixels=arch["min_pixels"], max_pixels=arch["max_pixels"])
