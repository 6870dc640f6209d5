"""OpenAI tool calling, server-independent: the request's tools (``spec``), the call formats (``formats``:
hermes, llama3, mistral) with their streaming parsers (``parser``) and constraint regexes. Torch-free."""
