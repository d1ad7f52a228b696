"""The conversation: the chat view and input, what the user can do to a chat, the saved-chat list, export, and
what a turn leaves in the history."""
