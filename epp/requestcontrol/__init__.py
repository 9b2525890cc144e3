"""Request control: the pipeline the director runs, admission, the director that schedules a parsed request,
and one request's lifecycle."""
