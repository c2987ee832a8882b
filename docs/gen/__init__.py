"""The documentation pages generated from the code and from bench/results, written on every `make docs`.

Each function returns one markdown fragment; `python -m docs.gen OUT` writes them into OUT (.docs-gen/),
where the hand-written pages include them (pymdownx.snippets: `--8<-- "config-reference.md"`). Nothing
generated is committed, so a page cannot drift from the schema, the command line or the measurements.
"""
