"""Example plug-ins of each rollout layer (used by the layers' contract tests and the README)."""

from __future__ import annotations

from milepost.data.source import PromptItem
from milepost.rollout.generate import RolloutResult, generate_one
from milepost.rollout.layers import GenerateContext, RolloutContext
from milepost.types import Sample


async def two_pass_generate(ctx: GenerateContext, item: PromptItem, index: int) -> Sample:
    """A generate fn that records its own tokens: a first completion, then a second one that
    continues it after a fixed hint (hint tokens get loss mask 0)."""
    client = ctx.clients[0]
    first = await generate_one(client, item, ctx.sampling, index, group_index=ctx.group_index)
    hint = [1, 2]  # <|im_start|> <|im_end|> in the tiny tokenizer: any ids the engine accepts
    second = await client.generate(first.tokens + hint, ctx.sampling.to_params())
    first.tokens += hint + second.output_ids
    first.response_length += len(hint) + len(second.output_ids)
    first.loss_mask += [0] * len(hint) + [1] * len(second.output_ids)
    first.rollout_logprobs += [0.0] * len(hint) + second.logprobs
    first.weight_versions += [second.weight_version] * len(hint) + second.weight_versions
    first.metadata["passes"] = 2
    return first


OWN_TASKS = ["Weather in Oslo?", "Weather in Rome?"]


async def own_taskset_rollout(ctx: RolloutContext) -> RolloutResult:
    """A rollout fn that brings its own task set and a group reward (rank by length: the shortest
    answer of each group gets 1, the others 0), ignoring the run's prompts."""
    result = RolloutResult()
    for g, task in enumerate(OWN_TASKS[: ctx.num_groups]):
        gctx = ctx.generate_context(ctx.group_index_start + g)
        item = PromptItem(index=g, prompt=task, prompt_ids=[1] + list(task.encode()[:8]) + [2])
        group = [await ctx.generate_fn(gctx, item, k) for k in range(ctx.n_samples_per_prompt)]
        shortest = min(s.response_length for s in group)
        for s in group:
            s.reward = float(s.response_length == shortest)
        result.groups.append(group)
    return result


async def broken_generate(ctx: GenerateContext, item: PromptItem, index: int) -> dict:
    """Breaks the generate fn contract (returns a dict): the rollout must refuse it."""
    return {"tokens": []}
