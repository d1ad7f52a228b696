"""The engine thread and the only code that holds engine objects; the rest of the app hears from it through the
frozen events in messages.py. Imports store/, never a widget."""
