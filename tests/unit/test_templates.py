import jinja2
import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template

from raylora.templates import ALPACA, CHATML, compile_template

# Exercises what real templates use: namespace state across a loop, loop controls, tojson of non-ASCII
# data, a generation block, dict(), raise_exception on a bad role, and whitespace control.
RICH = """{%- set ns = namespace(turns=0, last='') -%}
{%- for m in messages -%}
  {%- if m['role'] not in ['system', 'user', 'assistant', 'tool'] -%}{{ raise_exception('bad role ' + m['role']) }}{%- endif -%}
  {%- if m['role'] == 'tool' -%}{%- continue -%}{%- endif -%}
  {%- set ns.turns = ns.turns + 1 -%}
  {%- set ns.last = m['role'] -%}
  <|{{ m['role'] }}|>
  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}
  {{ dict(role=m['role'], n=loop.index) | tojson }}
  {%- if loop.index > 6 -%}{%- break -%}{%- endif -%}
{% endfor -%}
{{ ns.turns }} turns, last {{ ns.last }}{{ tools | tojson(indent=2) if tools else '' }}
{%- if add_generation_prompt %}<|assistant|>
{% endif -%}"""
MESSAGES = [
    {"role": "system", "content": "Réponds en français, 简洁。"},
    {"role": "user", "content": "  hello  "},
    {"role": "assistant", "content": "  bonjour \n"},
    {"role": "tool", "content": '{"x": 1}'},
    {"role": "user", "content": "<b>again</b>"},
    {"role": "assistant", "content": "encore"},
]


@pytest.mark.parametrize("template", [CHATML, ALPACA, RICH])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_renders_exactly_as_transformers(template, generation_prompt):
    kwargs = {"messages": MESSAGES, "add_generation_prompt": generation_prompt, "eos_token": "</s>"}
    tools = [{"name": "météo", "parameters": {"ville": "string"}}]
    ours, theirs = compile_template(template), _compile_jinja_template(template)
    assert ours.render(**kwargs) == theirs.render(**kwargs)
    assert ours.render(tools=tools, **kwargs) == theirs.render(tools=tools, **kwargs)


def test_raise_exception_and_the_sandbox_hold():
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role robot"):
        compile_template(RICH).render(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{% set ns = namespace(_private=1) %}").render()
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{{ messages.append(1) }}").render(messages=[])
    assert compile_template("{{ messages.__class__ }}").render(messages=[]) == ""
