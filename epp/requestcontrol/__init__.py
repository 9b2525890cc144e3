"""Request control: admission, the director that schedules a parsed request, and one request's lifecycle."""
