"""`task.name: shapes`: a generated image task for vision-language models. Each image (Pillow-drawn,
64 x 64 on a white ground: 4 image tokens on preset:vlm-tiny) holds two shapes of different kinds and
colours, one per half; the question names one shape ("What colour is the triangle?") and the answer
is its colour, one of four (chance 25%).

Held-out images are never trained on: an image is fixed by its discrete layout (the two shapes, their
colours, which half each sits in), eval layouts are drawn first from their own seeded stream, and the
training stream skips any layout the eval set holds (so no eval image, nor a pixel-identical copy,
is ever a training prompt).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from trainfit.tasks.base import Example, Task

SHAPES = ("triangle", "square", "circle")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (230, 200, 0)}
SIZE = 64
PLACEHOLDER = "<image>"   # where the image goes in the prompt text (vision/data.py's convention)


@dataclass
class ImageExample(Example):
    """An Example whose prompt carries images: `images` are RGB PIL images, one per `<image>`
    placeholder in the prompt text, in order."""

    images: list = field(default_factory=list)


def draw(layout: tuple) -> "object":
    """The RGB image of a layout ((shape, colour), (shape, colour)): first in the left half, second in
    the right half."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    d = ImageDraw.Draw(im)
    for k, (shape, colour) in enumerate(layout):
        x0, y0, s = 4 + k * 32, 18, 24                      # a 24 x 24 box in each half
        fill = COLOURS[colour]
        if shape == "square":
            d.rectangle([x0, y0, x0 + s, y0 + s], fill=fill)
        elif shape == "circle":
            d.ellipse([x0, y0, x0 + s, y0 + s], fill=fill)
        else:
            d.polygon([(x0 + s // 2, y0), (x0, y0 + s), (x0 + s, y0 + s)], fill=fill)
    return im


def _layout(rng: random.Random) -> tuple:
    shapes = rng.sample(SHAPES, 2)
    colours = rng.sample(sorted(COLOURS), 2)
    return tuple(zip(shapes, colours))


class ShapesTask(Task):
    name = "shapes"
    num_train = None   # generated: an unbounded stream

    def __init__(self, seed: int = 0, num_eval: int = 32, chat: bool = True) -> None:
        super().__init__(seed=seed, num_eval=num_eval, chat=chat)
        rng = random.Random(f"shapes-eval|{seed}")
        self._eval: list[tuple[tuple, int]] = []   # (layout, index of the asked shape)
        seen: set = set()
        while len(self._eval) < num_eval and len(seen) < self.num_layouts():
            lay, asked = _layout(rng), rng.randrange(2)
            if lay not in seen:   # distinct images
                seen.add(lay)
                self._eval.append((lay, asked))
        self._held_out = {lay for lay, _ in self._eval}
        if len(self._held_out) >= self.num_layouts():
            raise ValueError(f"task.num_eval={num_eval} holds out every one of the {self.num_layouts()} layouts; "
                             "lower it so some remain for training.")

    @staticmethod
    def num_layouts() -> int:
        """Distinct images: ordered shape pairs x ordered colour pairs."""
        n, c = len(SHAPES), len(COLOURS)
        return n * (n - 1) * c * (c - 1)

    def _example(self, layout: tuple, asked: int) -> ImageExample:
        shape, colour = layout[asked]
        text = f"{PLACEHOLDER}What colour is the {shape}?"
        fields = {"layout": [list(p) for p in layout], "shape": shape}
        ex = self.make_example(text, colour, colour, fields)
        return ImageExample(ex.prompt, ex.messages, ex.answer, ex.target, ex.fields, images=[draw(layout)])

    def train_example(self, i: int) -> ImageExample:
        rng = random.Random(f"shapes-train|{self.seed}|{i}")
        while True:   # skip held-out layouts (at most num_eval of the 72)
            lay = _layout(rng)
            if lay not in self._held_out:
                return self._example(lay, rng.randrange(2))

    def eval_examples(self) -> list[ImageExample]:
        return [self._example(lay, k) for lay, k in self._eval]

    def is_correct(self, completion: str, ex: Example) -> bool:
        return first_colour(completion) == ex.answer

    def stop_strings(self) -> list[str]:
        return []


def first_colour(text: str) -> Optional[str]:
    """The first colour word in `text` (lower-cased), or None."""
    words = [w.strip(".,!?:;\"'") for w in text.lower().split()]
    return next((w for w in words if w in COLOURS), None)
