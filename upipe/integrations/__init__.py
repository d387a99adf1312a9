"""Adapters that put upipe's CP attention into other libraries' models.

Each lives in its own module and imports its library only when that module is imported:
``upipe.integrations.hf`` (Hugging Face ``transformers``, ``pip install 'upipe[hf]'``).
"""
