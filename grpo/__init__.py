"""The parts of the GRPO recipes (`recipes/`), one idea per module, imported as `grpo.<module>`.

docs/layout.md says what each module holds.
"""
