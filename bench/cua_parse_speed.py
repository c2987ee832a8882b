"""How long the computer-use action parser (trainfit/envs/cua_actions.py) takes on adversarial replies of
growing length, with the service's reply cap lifted: linear time means each doubling of the length about
doubles the time. (The recursive parser it replaced took 20 s on the first input at 128 KB.)

    .venv/bin/python -m bench.cua_parse_speed
"""

from __future__ import annotations

import time

from trainfit.envs import cua_actions

INPUTS = {
    "click(\"a)a)...": lambda n: 'click("' + "a)" * (n // 2),
    "click(click(...": lambda n: "click(" * (n // 6),
    "click(1, 2) x n": lambda n: "click(1, 2) " * (n // 12),
    "<tool_call>[[[...": lambda n: "<tool_call>" + "[" * n + "</tool_call>",
    "<tool_call> x n": lambda n: "<tool_call>" * (n // 11),
    "click( spaces 1, 2)": lambda n: "click(" + " " * n + "1, 2)",
}


def main() -> None:
    cua_actions.MAX_REPLY_CHARS = 1 << 24
    sizes = [16_000, 32_000, 64_000, 128_000, 1_048_576]
    print(f"{'input':22}" + "".join(f"{s // 1000:>9} KB" for s in sizes))
    for name, make in INPUTS.items():
        row = []
        for n in sizes:
            text = make(n)
            began = time.perf_counter()
            cua_actions.parse_action(text, 160, 210)
            row.append(time.perf_counter() - began)
        print(f"{name:22}" + "".join(f"{t * 1000:>9.2f} ms" for t in row))


if __name__ == "__main__":
    main()
