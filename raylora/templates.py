"""Chat templates raylora ships: used when a tokenizer has none, or when a job names one."""

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


def compile_template(source: str):
    """A chat template compiled as Hugging Face tokenizers render it, with jinja2 alone.

    Same environment as ``transformers``' ``apply_chat_template``: sandboxed and immutable, ``trim_blocks``
    and ``lstrip_blocks``, loop controls, ``{% generation %}`` blocks (rendered as their body), ``tojson``
    without HTML escaping, ``raise_exception``, ``strftime_now``, and a ``namespace`` that refuses
    underscore names. Data workers use this instead of importing transformers, which costs each new
    worker process about 0.4 s.
    """
    import json
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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
