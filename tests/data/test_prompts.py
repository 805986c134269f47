"""Prompt formats: the chat prompt is the tokenizer's chat template output; plain stays the template."""

import pytest

from rltt.errors import ConfigError, RlttError
from rltt.data.gsm8k import DEFAULT_TEMPLATE, format_prompt
from rltt.data.prompts import ChatPrompt, prompt_renderer
from rltt.orchestration.prompt_stream import PromptStream, eval_tasks, make_task

from .chat_tokenizer import chat_tokenizer

RECORD = {"id": "q1", "question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"}


def encoder(tok):
    return lambda text: tok(text, add_special_tokens=False).input_ids


def test_chat_prompt_equals_the_template_output():
    tok = chat_tokenizer()
    render = prompt_renderer("chat", tok, system_prompt="Reason step by step.", options={"enable_thinking": True})
    assert isinstance(render, ChatPrompt)
    messages = [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": RECORD["question"]}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    task = make_task(RECORD, encoder(tok), render)
    assert task.prompt == expected
    assert task.prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert task.prompt_ids == tok(expected, add_special_tokens=False).input_ids
    think = tok.convert_tokens_to_ids("<think>")
    assert task.prompt_ids[-2] == think  # special tokens of the template are single ids
    without_system = make_task(RECORD, encoder(tok), prompt_renderer("chat", tok))
    assert without_system.prompt == tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)


def test_train_and_eval_tasks_share_the_renderer():
    tok = chat_tokenizer()
    render = prompt_renderer("chat", tok)
    train = PromptStream("synthetic:quickstart", encoder(tok), render, seed=3).next(2)
    held = eval_tasks(None, "synthetic:quickstart", encoder(tok), render, "test", 2, 3)
    for task in train + held:
        assert task.prompt.startswith("<|im_start|>user\n") and task.prompt.endswith("<|im_start|>assistant\n")
        assert task.prompt == render(task.prompt[len("<|im_start|>user\n"): task.prompt.index("<|im_end|>")])
    assert str(render) == "chat:" + render("{question}")  # the stable description curation records


def test_plain_format_is_the_template():
    tok = chat_tokenizer()
    assert prompt_renderer("plain", tok, DEFAULT_TEMPLATE) == DEFAULT_TEMPLATE
    task = make_task(RECORD, encoder(tok), prompt_renderer("plain", tok, "Q: {question}\nA:"))
    assert task.prompt == format_prompt(RECORD["question"], "Q: {question}\nA:")


def test_chat_without_a_template_is_one_clear_error():
    with pytest.raises(RlttError, match="data.prompt_format: chat needs a tokenizer with a chat template") as info:
        prompt_renderer("chat", chat_tokenizer(with_template=False))
    assert "\n" not in str(info.value)
    with pytest.raises(RlttError, match="data.system_prompt"):
        prompt_renderer("plain", chat_tokenizer(), system_prompt="hi")
    with pytest.raises(RlttError, match="data.prompt_format"):
        prompt_renderer("markdown", chat_tokenizer())


def test_recipe_keys_are_validated():
    from rltt.orchestration.train_recipe import load_train_recipe

    recipe = load_train_recipe(None, ["data.prompt_format=chat", "data.system_prompt=Think.",
                                      "rollout.thinking.budget=32", "rollout.max_new_tokens=64"])
    assert recipe.data.prompt_format == "chat" and recipe.rollout.thinking.budget == 32
    for override, key in (("data.prompt_format=html", "data.prompt_format"),
                          ("data.system_prompt=x", "data.system_prompt"),
                          ("rollout.thinking.budget=65", "rollout.thinking.budget"),
                          ("rollout.thinking.answer_budget=0", "rollout.thinking.answer_budget")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_train_recipe(None, ["rollout.max_new_tokens=64", override])
