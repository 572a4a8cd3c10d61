"""The prompts and grader of an RL script (grpo, dapo, grpo_async, ppo, ppo_async, vineppo, drca): its train split
minus a dev slice, a fixed sample of the held-out split, the dev slice, and the reward function, all validated at
start-up so that a bad row, column or reward function stops the run before anything is written.

    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer, rm_path)

It reads the scripts' shared flag names (dataset, train_split, eval_split, prompt_key, answer_key, prompt_template,
chat_template, max_prompt_length, eval_num_prompts, dev_num_prompts, reward_fn, best_metric).
"""

from __future__ import annotations

from shared import data as data_utils
from shared.rewards import RewardFn, load_reward_fn, probe_reward_fn


def load_prompt_task(args, tokenizer, rm_path: str = "", graded: bool | None = None) -> tuple[data_utils.PromptData, data_utils.PromptData,
                                                                   data_utils.PromptData, RewardFn | None]:
    """(train, eval, dev, reward_fn). The dev slice (args.dev_num_prompts train prompts kept out of training) picks
    output_dir/best; the eval set is args.eval_num_prompts held-out prompts, a fixed sample. With a reward model
    (rm_path) and no answer column there is no grader: reward_fn is None, no accuracy is reported, and a
    best_metric left at dev/accuracy becomes dev/reward (the reward model's score on the dev slice). `graded` given:
    whether there is a grader at all (drca.py's `--reward_fn none`: none)."""
    if graded is None:
        graded = not rm_path or data_utils.has_column(args.dataset, (args.train_split, args.eval_split), args.answer_key)
    if args.eval_num_prompts == 0:  # the sampler reads 0 as no limit: the whole eval split, every evaluation
        raise ValueError("eval_num_prompts: 0 would evaluate the whole eval split at every evaluation; pass a count "
                         "(a split with fewer rows is evaluated whole)")
    if graded and not args.answer_key:  # else no row has a gold answer, and the grader fails mid-run
        raise ValueError("answer_key: empty, but the reward function grades against the gold answer column (name it, "
                         "or score with --reward_model_path)")

    def load(split: str, limit: int | None = None, num_dev: int = 0, part: str = "train") -> data_utils.PromptData:
        return data_utils.load_prompts(args.dataset, split, tokenizer, args.prompt_key,
                                       args.answer_key if graded else "", args.prompt_template, args.chat_template,
                                       args.max_prompt_length, limit=limit, num_dev=num_dev, part=part)

    train_data = load(args.train_split, num_dev=args.dev_num_prompts, part="train")
    eval_data = load(args.eval_split, args.eval_num_prompts)
    dev_data = load(args.train_split, num_dev=args.dev_num_prompts, part="dev")
    reward_fn = load_reward_fn(args.reward_fn, args.dataset) if graded else None
    if reward_fn is not None:
        probe_reward_fn(reward_fn, train_data.rows)
    if not graded and args.best_metric == "dev/accuracy":
        args.best_metric = "dev/reward"
    return train_data, eval_data, dev_data, reward_fn


def task_summary(train_data: data_utils.PromptData, eval_data: data_utils.PromptData, dev_data: data_utils.PromptData,
                 num_steps: int, batch_size: int) -> str:
    """The start-up line `1000 train prompts (0 over max_prompt_length dropped), 500 eval prompts, 100 dev prompts,
    200 steps of 512 completions`."""
    return (f"{len(train_data.rows)} train prompts ({train_data.num_filtered} over max_prompt_length dropped), "
            f"{len(eval_data.rows)} eval prompts, {len(dev_data.rows)} dev prompts, {num_steps} steps of "
            f"{batch_size} completions")
