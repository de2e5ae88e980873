"""The embedded tasks: the default GSM8K-style model and problems (`grpo.tasks.tiny_gsm8k`), the tool task
(`grpo.tasks.tiny_tools`), the key-chain task and its model (`grpo.tasks.key_chain`, `grpo.tasks.tiny_key_chain`),
guess-the-number and its model (`grpo.tasks.guess_number`, `grpo.tasks.tiny_guess`), the tools
(`grpo.tasks.tool_functions`) and the rewards (`grpo.tasks.rewards`), each named in a config by module
(``grpo.tasks.rewards:gsm8k_exact_answer_reward``).
"""
