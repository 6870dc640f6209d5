"""The radixrt frontend language (SGLang-compatible DSL)."""
