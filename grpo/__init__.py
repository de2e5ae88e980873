"""The parts of the GRPO recipes (`recipes/`), one idea per module, imported as `grpo.<module>`.

README.md's layout says what each module holds.
"""
