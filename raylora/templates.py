"""Chat templates raylora ships: used when a tokenizer has none, or when a job names one."""

import json
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ALPACA = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'user' %}{{ '### Instruction:\n' + m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '### Response:\n' + m['content'] + eos_token + '\n\n' }}"
    "{% else %}{{ '### Tool result:\n' + m['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)
FALLBACK_TEMPLATES = {"chatml": CHATML, "alpaca": ALPACA}

# Tools for templates that do not render them (the "hermes" fallback): the function schemas in the system
# message, calls as <tool_call> JSON in the assistant's text, results in a user turn, as Qwen2.5 and Hermes 2 Pro
# are trained to read them.
HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def hermes_tools(tools: list[dict]) -> str:
    """The system text that shows ``tools`` (OpenAI function schemas), one JSON schema a line."""
    return HERMES_TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + HERMES_TOOLS_FOOTER


def hermes_tool_call(call: dict) -> str:
    """One tool call (``{"type": "function", "function": {"name", "arguments"}}``) as the assistant writes it."""
    fn = call["function"]
    arguments = json.dumps(fn["arguments"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {arguments}}}\n</tool_call>'


def hermes_tool_response(content: str) -> str:
    """A tool's result as the user turn that carries it back shows it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def think(reasoning: str, content: str) -> str:
    """An answer with its reasoning before it, for templates with no field of their own for reasoning."""
    return f"<think>\n{reasoning}\n</think>\n\n{content}"


def compile_template(source: str):
    """A chat template compiled as Hugging Face tokenizers render it, with jinja2 alone.

    Same environment as ``transformers``' ``apply_chat_template``: sandboxed and immutable, ``trim_blocks``
    and ``lstrip_blocks``, loop controls, ``{% generation %}`` blocks (rendered as their body), ``tojson``
    without HTML escaping, ``raise_exception``, ``strftime_now``, and a ``namespace`` that refuses
    underscore names. Data workers use this instead of importing transformers, which costs each new
    worker process about 0.4 s.
    """

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore names ({name!r})")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=Namespace,
        dict=TemplateDict(),
    )
    return env.from_string(source)
