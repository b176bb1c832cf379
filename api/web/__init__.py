"""The web queue view: server-rendered pages (Jinja2) with a small script, live through the streams."""
