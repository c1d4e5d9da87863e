"""Structured output: constrain a request's tokens to a JSON schema, a grammar or a regex.

`spec` (light: imported by SamplingParams) says what a request asks for; `matcher` compiles it with
llguidance (imported only when a request is constrained) and gives each sequence its token mask;
`tools` turns OpenAI tool definitions into a model family's call syntax and parses calls back.
"""
