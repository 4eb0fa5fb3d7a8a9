"""How a server's TLS certificate is checked: the ``verify`` setting, resolved once."""

from __future__ import annotations

import os
import ssl

from llm_annotator.errors import ConfigurationError

Verify = bool | str | os.PathLike[str] | ssl.SSLContext
"""How to check a server's TLS certificate: ``True`` (the system's trusted CAs), a
path to a CA bundle (a PEM file, or a directory of them), a ready
:class:`ssl.SSLContext`, or ``False`` (no check at all)."""


def ssl_setting(verify: Verify) -> ssl.SSLContext | bool:
    """What aiohttp's connector takes for ``verify``: True, False or a context.

    Raises:
        ConfigurationError: If ``verify`` is a path that holds no readable CA bundle, or
            not one of the accepted types.

    Examples:
        >>> ssl_setting(True), ssl_setting(False)
        (True, False)
        >>> ssl_setting("/no/such/ca.pem")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: verify='/no/such/ca.pem': no CA bundle there ...
    """
    if isinstance(verify, bool):
        return verify
    if isinstance(verify, ssl.SSLContext):
        return verify
    if isinstance(verify, str | os.PathLike):
        path = os.fspath(verify)
        try:
            if os.path.isdir(path):
                return ssl.create_default_context(capath=path)
            return ssl.create_default_context(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"verify={path!r}: no CA bundle there ({exc}); give the path of a PEM file "
                "with the certificate authority that signed the servers' certificates"
            ) from None
    raise ConfigurationError(
        "verify must be True, False, a CA bundle path or an ssl.SSLContext, "
        f"got {type(verify).__name__}"
    )


def unverified_context() -> ssl.SSLContext:
    """A TLS context that checks neither the certificate nor the host name."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
