"""`localllm chat`: the conversation (session.py, no terminal code) and the terminal loop (repl.py)."""

from localllm.chat.session import ChatSession, Prompt, TurnStats

__all__ = ["ChatSession", "Prompt", "TurnStats"]
