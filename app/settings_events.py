"""What the web UI's Settings tab does: the server's settings, one set shared by every page.

`form` gives the values the server runs now (a page shows them when it opens and when its
Settings tab is chosen); `apply` changes them (`Service.apply`: a new model reloads the engine and
stops every feed), keeping the fields the page left as it showed them, and only for the users of
`settings_by` where the server names them (`ui --settings-by`). Each Apply is in the activity log.
"""

import gradio as gr

from app import activity
from app.errors import UIError
from app.page_values import number, user_error
from app.service import Service
from app.settings import Settings
from engine import VlmstreamError


class SettingsEvents:
    def __init__(self, service: Service, settings_by: frozenset[str] | None = None):
        """settings_by: the users who may apply them; None: every user."""
        self.service = service
        self.settings_by = settings_by

    def apply(self, model, device, temperature, max_tokens, pipelined, sticky=Settings.sticky, hold=Settings.hold,
              shown: tuple | None = None, request: gr.Request = None):
        """`shown`: the form as this page last showed it (`form`; None from the API). A field
        the user left as shown keeps the server's setting: another page may have applied a new one
        meanwhile, which this page's Apply of another field had put back. With `settings_by`, only
        those users may: a new model stops every viewer's feeds and video jobs."""
        sid = getattr(request, "session_hash", None)
        activity.seen(sid, getattr(request, "username", None))
        if self.settings_by is not None and getattr(request, "username", None) not in self.settings_by:
            activity.settings_refused(sid)
            raise user_error(f"only {', '.join(sorted(self.settings_by))} may change this server's settings "
                             "(vlmstream ui --settings-by)")
        if shown is not None:
            fields = (model, device, temperature, max_tokens, pipelined, sticky, hold)
            model, device, temperature, max_tokens, pipelined, sticky, hold = (
                now if field == was else field for field, was, now in zip(fields, shown, self._form()))
        try:
            # A box left empty comes as None: the setting as it is (float(None) escaped as a TypeError).
            now = self.service.settings
            applied = []
            msg = self.service.apply(Settings(model=(model or "tiny").strip(), device=device, dtype=now.dtype,
                                         temperature=number(temperature, now.temperature, "temperature"),
                                         max_tokens=number(max_tokens, now.max_tokens, "max tokens"),
                                         pipelined=bool(pipelined), sticky=number(sticky, now.sticky, "steadiness"),
                                         hold=number(hold, now.hold, "frames a change holds")),
                                     on_applied=lambda old, new: applied.append((old, new)))
        except (UIError, VlmstreamError, OSError) as e:
            raise user_error(str(e)) from None
        activity.settings_applied(sid, *applied[0], msg)
        return msg

    def form(self) -> tuple:
        """The Settings form's values as the server runs now (`apply`'s fields, in its order): a page
        showed those of the server's start, and after another page's Apply its form, sent again
        to change one field, put the others back."""
        form = self._form()
        return *form, form  # the fields, and what the page then shows (`apply`'s `shown`)

    def _form(self) -> tuple:
        s = self.service.settings
        return s.model, s.device, s.temperature, s.max_tokens, s.pipelined, s.sticky, s.hold
