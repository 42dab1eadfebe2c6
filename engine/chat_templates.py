"""Known chat formats of model families, for GGUFs that carry no usable chat template."""

from __future__ import annotations

# Gemma's turn format (as its own template and llama.cpp's built-in "gemma" one): no system
# role, so a system prompt opens the first user turn; "assistant" is "model"; BOS leads.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first and role == 'user' else '') "
    "+ m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

FAMILY_TEMPLATES = {"gemma3": ("Gemma", GEMMA_TEMPLATE)}
BASE_MODEL_NOTE = ("a GGUF without a chat template is usually a base model, which continues "
                   "text rather than chats")


def family_template(arch: str | None) -> tuple[str, str] | None:
    """(family name, template) for an architecture with a known chat format, else None."""
    return FAMILY_TEMPLATES.get(arch or "")
