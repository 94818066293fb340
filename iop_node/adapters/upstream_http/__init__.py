"""The parts of one exchange with an HTTP upstream that the OpenAI-compatible adapter
(`adapters.openai_compat`) is made of, each named after what it owns: how a failure is
worded (`failures`), how a run's request and response travel (`exchange`), what a native
protocol's reply becomes on its way back (`native_exchange`), and what the runtime's
context holds (`context_window`)."""
