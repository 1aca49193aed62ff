"""Data layer: read conversations, split them, tokenise them with a verified assistant-only loss mask."""
from specheads.data.conversations import (
    Conversation,
    DataError,
    Message,
    ReadStats,
    read_conversations,
    split_heldout,
)
from specheads.data.tokenize import (
    TemplateError,
    TokenizedSample,
    TokenizeStats,
    assistant_mask_from_generation_markers,
    collate,
    tokenize_all,
    tokenize_conversation,
)

__all__ = [
    "Conversation", "DataError", "Message", "ReadStats", "read_conversations", "split_heldout",
    "TemplateError", "TokenizedSample", "TokenizeStats", "assistant_mask_from_generation_markers",
    "collate", "tokenize_all", "tokenize_conversation",
]
