"""The Edge's HTTP surfaces: the run endpoints, the rest of the OpenAI API, the admin API.

Handlers receive the narrow interfaces they need from the composition root (`edge.py`);
none of them imports the Edge itself. HTTP statuses, OpenAI error bodies and headers are
decided here and nowhere else.
"""
