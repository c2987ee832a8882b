"""`task.name: shapes`: a generated image task for vision-language models. Each image (Pillow-drawn,
64 x 64 on a white ground: 4 image tokens on preset:vlm-tiny, one per 32 x 32 quadrant) holds two
shapes of different kinds and colours in two different quadrants; the question names one shape ("What
colour is the triangle?") and the answer is its colour, one of four (chance 25%).

The layout varies so that held-out images are new images, not a handful of repeats: the two quadrants
(side by side, stacked or diagonal), each shape's side (24..32 px) and its position inside its quadrant
are drawn at random, about 23 million layouts in all (`num_layouts`). A shape never leaves its
quadrant, so each image token sees at most one shape whole: large shapes aligned to the tokens are what
keeps the task learnable in minutes by a random-init model this small (12-14 px shapes, one per
16 px patch, stayed at chance after 400 SFT steps on 3 seeds).

Held-out images are never trained on: an image is fixed by its layout (each shape's kind, colour, box),
eval layouts are drawn first from their own seeded stream, and the training stream skips any layout
the eval set holds (so no eval image, nor a pixel-identical copy, is ever a training prompt).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from trainfit.tasks.base import Example, Task

SHAPES = ("triangle", "square", "circle")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (230, 200, 0)}
SIZE = 64
QUAD = 32                  # the image's four 32 x 32 quadrants (one image token each on vlm-tiny)
SIDES = (24, 26, 28, 30, 32)   # a shape's bounding-box side, pixels; the box lies inside its quadrant
PLACEHOLDER = "<image>"   # where the image goes in the prompt text (data/image_chat.py's convention)


@dataclass
class ImageExample(Example):
    """An Example whose prompt carries images: `images` are RGB PIL images, one per `<image>`
    placeholder in the prompt text, in order."""

    images: list = field(default_factory=list)


def draw(layout: tuple) -> "object":
    """The RGB image of a layout: a tuple of (shape, colour, x0, y0, side) boxes, drawn in order."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    d = ImageDraw.Draw(im)
    for shape, colour, x0, y0, s in layout:
        fill = COLOURS[colour]
        if shape == "square":
            d.rectangle([x0, y0, x0 + s - 1, y0 + s - 1], fill=fill)
        elif shape == "circle":
            d.ellipse([x0, y0, x0 + s - 1, y0 + s - 1], fill=fill)
        else:
            d.polygon([(x0 + s // 2, y0), (x0, y0 + s - 1), (x0 + s - 1, y0 + s - 1)], fill=fill)
    return im


def _layout(rng: random.Random) -> tuple:
    shapes = rng.sample(SHAPES, 2)
    colours = rng.sample(sorted(COLOURS), 2)
    quads = rng.sample(range(4), 2)   # two distinct quadrants: side by side, stacked or diagonal
    boxes = []
    for shape, colour, q in zip(shapes, colours, quads):
        s = rng.choice(SIDES)
        x0 = (q % 2) * QUAD + rng.randint(0, QUAD - s)
        y0 = (q // 2) * QUAD + rng.randint(0, QUAD - s)
        boxes.append((shape, colour, x0, y0, s))
    return tuple(boxes)


class ShapesTask(Task):
    name = "shapes"
    num_train = None   # generated: an unbounded stream

    def __init__(self, seed: int = 0, num_eval: int = 32, chat: bool = True) -> None:
        super().__init__(seed=seed, num_eval=num_eval, chat=chat)
        rng = random.Random(f"shapes-eval|{seed}")
        self._eval: list[tuple[tuple, int]] = []   # (layout, index of the asked shape)
        seen: set = set()
        if num_eval >= self.num_layouts():
            raise ValueError(f"task.num_eval={num_eval} holds out every one of the {self.num_layouts()} layouts; "
                             "lower it so some remain for training.")
        while len(self._eval) < num_eval:
            lay, asked = _layout(rng), rng.randrange(2)
            if lay not in seen:   # distinct images
                seen.add(lay)
                self._eval.append((lay, asked))
        self._held_out = seen

    @staticmethod
    def num_layouts() -> int:
        """Distinct images: ordered quadrant pairs x ordered shape pairs x ordered colour pairs x
        (side, position in the quadrant) choices per shape, squared."""
        n, c = len(SHAPES), len(COLOURS)
        per_box = sum((QUAD - s + 1) ** 2 for s in SIDES)   # sides x positions in a quadrant
        return 4 * 3 * n * (n - 1) * c * (c - 1) * per_box ** 2

    def _example(self, layout: tuple, asked: int) -> ImageExample:
        shape, colour = layout[asked][:2]
        text = f"{PLACEHOLDER}What colour is the {shape}?"
        fields = {"layout": [list(b) for b in layout], "shape": shape}
        ex = self.make_example(text, colour, colour, fields)
        return ImageExample(ex.prompt, ex.messages, ex.answer, ex.target, ex.fields, images=[draw(layout)])

    def train_example(self, i: int) -> ImageExample:
        rng = random.Random(f"shapes-train|{self.seed}|{i}")
        while True:   # skip held-out layouts (num_eval of ~23 million: almost never)
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
